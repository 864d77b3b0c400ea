"""scripts/gpu_check.sh --dry-run: the GPU check's params (vLLM backend, DeepSpeed) are valid through the
front door and its commands run every stage up to train with the same overrides. The GPU part itself
cannot run here (no GPU, no vLLM): docs/scale-out.md says what is untested."""

import subprocess
from pathlib import Path

from arpo_core.pipeline.table import STAGE_NAMES

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_validates_params_and_names_every_stage():
    res = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert any(line.startswith("[gpu_check] params valid:") for line in lines), res.stdout
    runs = [line for line in lines if "would run:" in line]
    upto_train = list(STAGE_NAMES[: STAGE_NAMES.index("train") + 1])
    assert [r.split(" stage ")[1].split()[0] for r in runs] == upto_train
    for r in runs:
        assert "-S policy.backend=vllm" in r and "-S train.engine=deepspeed" in r and "-S train.epochs=2" in r
    assert lines[-1] == "[gpu_check] would write benchmarks/results/gpu.json"
