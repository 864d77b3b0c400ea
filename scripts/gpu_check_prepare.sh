#!/usr/bin/env bash
# Prepares, HERE (where PyPI is reachable), the carry folder of the offline GPU check
# (benchmarks/gpu_offline.py, decision "Carried packages"): .gpu-offline/wheels/ holds the wheels the GPU
# node lacks, for its Python 3.12 on x86-64: transformers and DeepSpeed at this venv's versions and what
# their imports need there. Then it checks the size that travels (the tracked and untracked-not-ignored
# files plus the carry folder) against the device's 64 MiB and prints it.
#
#   bash scripts/gpu_check_prepare.sh             # download / build the wheels, print the carry size
#   bash scripts/gpu_check_prepare.sh --dry-run   # print the pins and the commands; download nothing
#
# DeepSpeed has no binary wheel: it is built here as a pure-Python wheel (DS_BUILD_OPS=0: its CUDA ops
# are compiled on first use there). The folder is git-ignored; carry it to the node (`carry: [.gpu-offline]`)
# and run scripts/gpu_check_offline.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${CARRY_DIR:-.gpu-offline}
LIMIT_MIB=64
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1

mapfile -t PINS < <("$PY" benchmarks/gpu_offline.py --print-pins)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
DOWNLOAD=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
          "${PLATFORMS[@]}" -d "$DIR/wheels")
BUILD=(env DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/wheels")

if [ "$DRY" = 1 ]; then
  for pin in "${PINS[@]}"; do
    case $pin in
      deepspeed==*) echo "[prepare] would run: ${BUILD[*]} $pin" ;;
      *) echo "[prepare] would run: ${DOWNLOAD[*]} $pin" ;;
    esac
  done
  echo "[prepare] would write $DIR/wheels and $DIR/manifest.txt"
  exit 0
fi

rm -rf "$DIR" && mkdir -p "$DIR/wheels"
for pin in "${PINS[@]}"; do
  echo "[prepare] $pin"
  case $pin in
    deepspeed==*) "${BUILD[@]}" "$pin" ;;
    *) "${DOWNLOAD[@]}" "$pin" ;;
  esac
done
n=$(ls "$DIR"/wheels/*.whl | wc -l)
[ "$n" = "${#PINS[@]}" ] || { echo "[prepare] expected ${#PINS[@]} wheels, found $n" >&2; exit 1; }
# DeepSpeed's wheel must hold no compiled op (they would be built for this machine's torch, not the node's).
unzip -l "$DIR"/wheels/deepspeed-*.whl | grep -qE '\.so$' && { echo "[prepare] deepspeed wheel has .so files" >&2; exit 1; }
(cd "$DIR/wheels" && sha256sum ./*.whl) > "$DIR/manifest.txt"
carry=$(du -sb "$DIR" | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=$((carry + tree))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "[prepare] carry $DIR: $n wheels, $(mib "$carry") MiB; with the working tree ($(mib "$tree") MiB): $(mib "$total") MiB of $LIMIT_MIB MiB"
[ "$total" -lt $((LIMIT_MIB * 1048576)) ] || { echo "[prepare] over the device's $LIMIT_MIB MiB" >&2; exit 1; }
