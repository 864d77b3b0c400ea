#!/usr/bin/env bash
# Creates the separate virtual environment for the official OSWorld `desktop-env` package, which cannot live
# in the training environment (it pins torch~=2.5, transformers~=4.35, numpy<2; docs/method.md §5).
# arpo_core/envs/osworld/desktop_env_bridge.py runs inside it and serves DesktopEnv over loopback HTTP.
#
#   scripts/setup_desktop_env.sh [VENV_DIR]      (default ~/.cache/arpo/desktop-env-venv)
#
# Idempotent: a second run with the same package version returns at once. Measured on the 2-core project
# machine: ~4 min, 7.1 GB (desktop-env 1.0.2 pulls a CUDA torch 2.5.1 and ~250 packages).
# Optional, for the end-to-end test: ARPO_DESKTOP_ENV_PYTHON=$VENV_DIR/bin/python pytest tests/test_osworld_bridge.py
set -euo pipefail
VENV=${1:-$HOME/.cache/arpo/desktop-env-venv}
SPEC=${DESKTOP_ENV_SPEC:-desktop-env==1.0.2}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.arpo-desktop-env-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$SPEC" ]; then
  echo "[desktop-env] $VENV already has $SPEC"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "[desktop-env] installing $SPEC into $VENV (several minutes, several GB)"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --upgrade pip
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "$SPEC"
# pyautogui needs an X display to import: only check that it is installed.
"$VENV/bin/python" -c "import desktop_env.desktop_env, pyperclip, Xlib, PIL, importlib.util as u; assert u.find_spec('pyautogui')" >/dev/null 2>&1 || {
  echo "[desktop-env] import check failed" >&2; exit 1; }
echo "$SPEC" >"$stamp"
echo "[desktop-env] ready: $VENV/bin/python"
