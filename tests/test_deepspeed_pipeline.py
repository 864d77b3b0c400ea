"""Issue 16 end to end: the quick pipeline with the DeepSpeed engine and the Ray env backend writes its
train checkpoints, and a train stage killed after an epoch checkpoint resumes from it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from orchestration_helpers import VENV_BIN, base_env, copy_project, start, stop

from arpo_core.algorithm.trainer import latest_checkpoint

OVERRIDES = ["--preset", "quick", "-S", "train.engine=deepspeed", "-S", "env.backend=ray"]
OUT = Path("models/arpo")
STAGED = Path("models/.arpo.staging")
"""Where the train stage writes while it runs (flows/runner.py, decision "Staged outputs"): a killed run's
checkpoints."""


def _run(cmd: list[str], project: Path, env: dict[str, str], log: Path, timeout_s: float) -> None:
    """Run `cmd` to completion in its own process group, which is removed afterwards whatever happened
    (a timed-out `arpo run` would leave its Prefect server and Ray head behind)."""
    proc = start(cmd, project, env, log)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{cmd[1:3]} still running after {timeout_s} s: {log.read_text()[-6000:]}")
    finally:
        stop(proc, grace_s=5)
    assert proc.returncode == 0, log.read_text()[-6000:]


def _state(project: Path, out: Path = OUT) -> tuple[str, dict]:
    ckpts = project / out / "checkpoints"
    name = (ckpts / "latest").read_text().strip()
    return name, json.loads((ckpts / name / "state.json").read_text())


def _inodes(project: Path, epochs: int, out: Path = OUT) -> dict[str, int]:
    """Inode of each trajectory file of the epochs <= `epochs`: a resumed run keeps them (the swap into
    place renames them), a run that started over writes them anew."""
    trajectories = project / out / "trajectories"
    files = [f for e in range(1, epochs + 1) for f in sorted(trajectories.glob(f"epoch-{e:04d}-*.parquet"))]
    assert files
    return {f.name: f.stat().st_ino for f in files}


@pytest.mark.slow
# hang guards below: 600 + 240 + 60 + 300 s; ~400 s in all on an idle 2-core machine
@pytest.mark.timeout(1500)
def test_quick_pipeline_deepspeed_ray_checkpoint_and_resume(tmp_path):
    project = copy_project(tmp_path / "p")
    # the copy's code runs (not the editable install's), with the DeepSpeed engine in one CPU process
    env = base_env(project) | {"PYTHONPATH": str(project), "OMP_NUM_THREADS": "1"}
    arpo = str(VENV_BIN / "arpo")

    # 1. the quick pipeline up to train (the stages after it use neither DeepSpeed nor anything Ray does
    # not already do in demos and baseline): several stages in one process each open and close a Ray pool
    _run(
        [arpo, "run", *OVERRIDES, "-S", "train.epochs=2", "--target", "train"],
        project,
        env,
        tmp_path / "run.log",
        600,
    )
    # the run's last log records reached the temporary API server before it was stopped
    assert "Error logging to API" not in (tmp_path / "run.log").read_text()
    name, state = _state(project)
    assert name == "epoch-0002" and state["epoch"] == 2 and len(state["history"]) == 2
    for e in (1, 2):  # DeepSpeed's own checkpoint under its fixed tag, no `latest` file of its own
        ds = project / OUT / "checkpoints" / f"epoch-{e:04d}" / "deepspeed"
        assert sorted(p.name for p in (ds / "state").glob("*.pt")), ds
        assert not (ds / "latest").exists()

    # 2. a 3-epoch train stage (a new configuration: its outputs start over in the staging area beside the
    # 2-epoch run's, flows/runner.py, decision "Staged outputs") killed once an epoch is checkpointed; the
    # same command again resumes from that checkpoint
    cmd = [arpo, "stage", "train", *OVERRIDES, "-S", "train.epochs=3"]
    proc = start(cmd, project, env, tmp_path / "train-killed.log")
    try:
        deadline = time.monotonic() + 240
        marker = project / ".arpo" / "stamps" / "train.running"  # written once the staging area is empty
        while time.monotonic() < deadline:
            if marker.exists() and latest_checkpoint(project / STAGED) is not None:
                break
            assert proc.poll() is None, (tmp_path / "train-killed.log").read_text()[-6000:]
            time.sleep(0.1)
        else:
            pytest.fail("no epoch checkpoint within 240 s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group we started: arpo, its Ray head
        proc.wait(timeout=60)
    name, killed = _state(project, STAGED)
    done = killed["epoch"]
    assert done in (1, 2) and name == f"epoch-{done:04d}"
    kept = _inodes(project, done, STAGED)
    assert _state(project)[1]["epoch"] == 2  # the previous output is untouched until the stage succeeds

    _run(cmd, project, env, tmp_path / "train-resumed.log", 300)
    name, resumed = _state(project)
    assert name == "epoch-0003" and resumed["epoch"] == 3 and len(resumed["history"]) == 3
    assert resumed["history"][:done] == killed["history"]  # the finished epochs' rows, unchanged
    assert _inodes(project, done) == kept  # and their files: nothing before the checkpoint was redone
    assert resumed["policy_version"] > killed["policy_version"]
