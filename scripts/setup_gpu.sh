#!/usr/bin/env bash
# A separate virtual environment for GPU machines with vLLM (docs/method.md §6: vLLM pins its own CUDA
# torch and transformers < 5.21, so it can never share the CPU environment in .venv).
#
#   bash scripts/setup_gpu.sh            # creates .venv-gpu
#   .venv-gpu/bin/python -c "from arpo_core.policy.generate import VLLMGenerator"
#
# The project itself is installed without its dependency pins (--no-deps) so that vLLM's torch and
# transformers stay; the light dependencies arpo_core needs are added explicitly. DeepSpeed training on
# GPUs uses the same environment (its CUDA kernels build against vLLM's torch).
# UNTESTED HERE: this machine kind has no GPU and vLLM has no CPU wheel; it was written from vLLM's
# published requirements, not run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3.11}
command -v nvidia-smi >/dev/null || { echo "setup_gpu.sh: no nvidia-smi: this needs a CUDA GPU machine" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm>=0.33" "deepspeed==0.19.8"
"$VENV/bin/python" -m pip install -q pyarrow pyyaml pillow typer tqdm requests
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, torch; print('[setup_gpu] vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
