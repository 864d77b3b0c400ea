#!/usr/bin/env bash
# The offline GPU check (benchmarks/gpu_offline.py): on one CUDA GPU with NO network, the project's own
# generator (HFGenerator) and update (ppo_update with DeepSpeed ZeRO-3/ZeRO-2 and the torch engine) at
# Qwen2.5-VL-7B shape with random weights and synthetic 1920x1080 screenshots, into
# benchmarks/results/gpu.json. Unlike scripts/gpu_check.sh it needs no vLLM, no browser and no PyPI:
# the node's own python3 (torch, numpy, PIL, ...) plus the wheels of .gpu-offline/wheels, which
# scripts/gpu_check_prepare.sh writes where PyPI is reachable.
#
#   bash scripts/gpu_check_prepare.sh            # here: the carry folder .gpu-offline
#   bash scripts/gpu_check_offline.sh            # there, in the repo root with .gpu-offline: < 8 minutes
#   bash scripts/gpu_check_offline.sh --dry-run  # here, on CPU: the same code at a tiny shape
#
# Extra arguments go to benchmarks/gpu_offline.py (e.g. --parts gen,zero3). Ran once on one H200
# (2026-12-04: docs/scale-out.md, "Measured on one H200"); the dry run is tested on CPU
# (tests/test_gpu_offline.py); what is untested: docs/scale-out.md, "Not run yet".
set -euo pipefail
cd "$(dirname "$0")/.."
RESULT=${RESULT:-benchmarks/results/gpu.json}

if [ "${1:-}" = "--dry-run" ]; then
  shift
  exec "${PYTHON:-.venv/bin/python}" benchmarks/gpu_offline.py --dry-run \
    --out "${RESULT_DRY:-${TMPDIR:-/tmp}/arpo-gpu-offline/gpu_dry_run.json}" "$@"
fi

T0=$(date +%s)
command -v nvidia-smi >/dev/null || { echo "gpu_check_offline.sh: no nvidia-smi: needs a CUDA GPU" >&2; exit 2; }
PY=${PYTHON:-python3}
DIR=${CARRY_DIR:-.gpu-offline}
SITE=${SITE:-/tmp/site}
compgen -G "$DIR/wheels/*.whl" >/dev/null || {
  echo "gpu_check_offline.sh: no wheels in $DIR/wheels: run scripts/gpu_check_prepare.sh where PyPI is" \
    "reachable and bring $DIR along" >&2
  exit 2
}
(cd "$DIR/wheels" && sha256sum --quiet -c ../manifest.txt) || { echo "gpu_check_offline.sh: $DIR differs from its manifest" >&2; exit 2; }
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/wheels/*.whl
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
# Fewer out-of-memory errors from fragmentation near the card's limit (the 7B update's 16 bytes/param).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# DeepSpeed's FusedAdam (the fused_adam part) is compiled for this GPU only, with every core (a node's
# arch-specific 9.0a is turned into 9.0 before the build: engines.py, decision "Arch list for the JIT build").
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
BUDGET=$(( ${BUDGET_S:-460} - ($(date +%s) - T0) ))
echo "[gpu_check_offline] wheels installed into $SITE in $(( $(date +%s) - T0 )) s; budget $BUDGET s"
# The budget's hard stop; the JSON is written after every part, so a stop keeps the parts before it.
timeout --kill-after=5 $((BUDGET + 10)) "$PY" benchmarks/gpu_offline.py --out "$RESULT" --budget-s "$BUDGET" "$@"
echo "[gpu_check_offline] $(( $(date +%s) - T0 )) s in all"
