#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine of this kind, idempotently:
#   1. Debian packages (Chromium + driver for MiniWoB, Xvfb desktop tools for OSWorld-protocol tasks),
#      only when one is missing (apt-get update first);
#   2. a virtual environment at .venv with torch's CPU build installed first (docs/method.md §6: a plain
#      `torch` requirement would pull a multi-GB CUDA build), then the project in editable mode.
# A stamp file keyed on pyproject.toml + requirements.lock makes the second run take about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(chromium chromium-driver xvfb openbox xdotool xterm x11-utils fonts-dejavu-core)
PYTHON=${PYTHON:-python3.11}
VENV=.venv

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

stamp="$VENV/.arpo-setup-stamp"
want=$(cat pyproject.toml $(ls requirements.lock 2>/dev/null) | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip_install() {
  # The machine's pip config lists local index folders that may be absent; drop that noise.
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$@" 2>&1 |
    { grep -vE "is ignored: it is neither|BuildBackendWarning|^ *!!|^ *\*+$|^ *$" || true; }
  return "${PIPESTATUS[0]}"
}
echo "[setup] installing Python packages into $VENV (first run: a few minutes)"
pip_install --upgrade "pip>=24" "setuptools>=77" wheel
pip_install "torch==2.13.0"
constraint=()
[ -f requirements.lock ] && constraint=(-c requirements.lock)
pip_install "${constraint[@]}" -e ".[dev]"
echo "$want" >"$stamp"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
