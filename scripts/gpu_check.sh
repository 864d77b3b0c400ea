#!/usr/bin/env bash
# GPU check of issue 16 item 6: on one CUDA GPU, two ARPO epochs on MiniWoB with vLLM generation
# (policy.backend=vllm, colocated, weights synced after every update) and DeepSpeed training, through the
# pipeline's own front door (`arpo stage` with preset quick and -S overrides), then
# benchmarks/results/gpu.json with the stage times and the largest |vLLM - trainer| log-prob difference.
#
#   bash scripts/gpu_check.sh              # on a GPU machine with network access (PyPI, Debian)
#   bash scripts/gpu_check.sh --dry-run    # anywhere: validate the params, print the commands, run nothing
#
# Budget 8 minutes: setup_gpu.sh (skipped when .venv-gpu holds vLLM), the tiny policy built offline
# (init_policy) and the versioned grounded checkpoint (ground), 3 demos per task + 10 SFT steps,
# baseline, select, train (2 epochs x 2 iterations), each stage under `timeout`.
# UNTESTED ON A GPU: no GPU was available when it was written; --dry-run is tested on CPU
# (tests/test_gpu_check.py). What is untested: docs/scale-out.md, "Not run yet".
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
VENV=${VENV:-.venv-gpu}
WORK=${WORK:-/tmp/arpo-gpu-check}
OUT=${OUT:-benchmarks/results/gpu.json}
SETS=(--preset quick -S policy.backend=vllm -S train.engine=deepspeed -S train.zero_stage=2 -S train.optimizer.bf16=true
      -S train.epochs=2 -S policy.vllm.gpu_memory_utilization=0.3 -S policy.vllm.max_model_len=4096
      -S policy.vllm.enforce_eager=true -S project.torch_threads=4)
STAGES=(init_policy ground demos sft baseline select train)
LIMIT_S=(60 60 90 90 90 10 240)

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m flows.cli params "${SETS[@]}" >/dev/null   # the same params, checked where no GPU is
  echo "[gpu_check] params valid: ${SETS[*]}"
  for i in "${!STAGES[@]}"; do
    echo "[gpu_check] would run: timeout ${LIMIT_S[$i]} $VENV/bin/arpo stage ${STAGES[$i]} ${SETS[*]}"
  done
  echo "[gpu_check] would write $OUT"
  exit 0
fi

command -v nvidia-smi >/dev/null || { echo "gpu_check.sh: no nvidia-smi: needs a CUDA GPU" >&2; exit 2; }
T0=$(date +%s)
"$VENV/bin/python" -c "import vllm" 2>/dev/null || bash scripts/setup_gpu.sh
command -v chromium >/dev/null || bash scripts/setup.sh --apt-only 2>/dev/null || true  # MiniWoB's browser
rm -rf "$WORK" && mkdir -p "$WORK"
git ls-files -z | xargs -0 -I{} cp --parents {} "$WORK"/ 2>/dev/null   # a clean project copy to run in
cd "$WORK"
declare -A SECS
for i in "${!STAGES[@]}"; do
  s=${STAGES[$i]}; t=$(date +%s)
  timeout "${LIMIT_S[$i]}" "$OLDPWD/$VENV/bin/python" -m flows.cli stage "$s" "${SETS[@]}" \
    > "$WORK/$s.log" 2>&1 || { echo "[gpu_check] stage $s failed (log $WORK/$s.log)"; tail -30 "$WORK/$s.log"; STATUS=failed_$s; break; }
  SECS[$s]=$(( $(date +%s) - t )); echo "[gpu_check] $s ${SECS[$s]} s"
done
cd "$OLDPWD"
STAGE_JSON=$(for s in "${!SECS[@]}"; do printf '"%s": %s,' "$s" "${SECS[$s]}"; done)
"$VENV/bin/python" - "$WORK" "$OUT" "${STATUS:-ok}" "{${STAGE_JSON%,}}" "$(( $(date +%s) - T0 ))" <<'PY'
import json, sys, pathlib, subprocess, datetime
work, out, status, stages, wall = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
state = work / "models/arpo/checkpoints"
hist = []
if (state / "latest").exists():
    hist = json.loads((state / (state / "latest").read_text().strip() / "state.json").read_text())["history"]
def ver(m):
    try: return __import__("importlib.metadata").metadata.version(m)
    except Exception: return None
gaps = [h.get("logprob/gen_vs_train_max_abs_per_token") for h in hist]
rec = {
    "benchmark": "gpu_check", "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "status": status, "wall_s": wall, "stage_s": stages,
    "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip(),
    "versions": {m: ver(m) for m in ("vllm", "torch", "transformers", "deepspeed")},
    "epochs": [{k: v for k, v in h.items() if k.startswith(("logprob/", "rollout/success", "time/", "loss/"))} for h in hist],
    "logprob_max_abs_diff_per_token": max((g for g in gaps if g is not None), default=None),
    "logprob_max_abs_diff_reply_sum": max((h.get("logprob/gen_vs_train_max_abs", 0) for h in hist), default=None),
}
pathlib.Path(out).write_text(json.dumps(rec, indent=1) + "\n")
print(json.dumps(rec, indent=1))
PY
echo "[gpu_check] wrote $OUT"
