"""DeepSpeed's JIT-built ops under a lock a killed builder cannot leave (arpo_core/algorithm/jit_builds.py):
torch's own lock files, orphaned by a builder killed mid-build, are removed under an flock the kernel drops
with its holder, and a DeepSpeed engine starts where one such file used to hang it for good."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from arpo_core.algorithm.jit_builds import LOCK_NAME, build_root, exclusive_builds

ROOT = Path(__file__).resolve().parents[1]


def _holds_flock(path: Path) -> bool:
    """Whether another process holds the exclusive flock on `path` now."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def test_orphaned_torch_locks_are_removed_in_either_layout_and_named(tmp_path, caplog):
    env_layout = tmp_path / "deepspeed_shm_comm" / "lock"  # TORCH_EXTENSIONS_DIR=<root>
    default_layout = tmp_path / "py311_cpu" / "fused_adam" / "lock"  # torch's default root
    for lock in (env_layout, default_layout):
        lock.parent.mkdir(parents=True)
        lock.touch()
    built = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built.write_bytes(b"\x7fELF")
    with (
        caplog.at_level(logging.WARNING, "arpo_core.algorithm.jit_builds"),
        exclusive_builds(tmp_path) as root,
    ):
        assert root == tmp_path and not env_layout.exists() and not default_layout.exists()
    assert built.exists()  # a build's output stays: only the lock files go
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2 and all("killed mid-build" in m for m in named), named
    assert str(env_layout) in named[0] + named[1] and str(default_layout) in named[0] + named[1]
    with caplog.at_level(logging.WARNING, "arpo_core.algorithm.jit_builds"), exclusive_builds(tmp_path):
        pass
    assert len(caplog.records) == 2  # nothing left to remove, nothing said


def test_the_build_lock_is_exclusive_and_dies_with_a_sigkilled_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import time
                from pathlib import Path
                from arpo_core.algorithm.jit_builds import exclusive_builds
                with exclusive_builds(Path({str(tmp_path)!r})):
                    print("held", flush=True)
                    time.sleep(600)
                """
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _holds_flock(tmp_path / LOCK_NAME)  # a second builder would wait here, not build beside it
        (tmp_path / "op").mkdir()
        (tmp_path / "op" / "lock").touch()  # what a build killed mid-way leaves (torch's FileBaton)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    t0 = time.monotonic()
    with exclusive_builds(tmp_path):  # the kernel dropped the flock with its holder
        assert not (tmp_path / "op" / "lock").exists()
    assert time.monotonic() - t0 < 10


def test_a_venv_builds_in_its_own_folder_unless_told_otherwise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    code = "from arpo_core.algorithm.jit_builds import build_root; import os; print(build_root());"
    code += "print(os.environ['TORCH_EXTENSIONS_DIR'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(Path(sys.prefix) / "torch-extensions")] * 2  # set for its children
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.split() == [str(tmp_path)] * 2


@pytest.mark.slow
def test_a_deepspeed_engine_starts_where_a_killed_build_left_its_lock():
    """The hang this module exists for: torch's lock file left in the shared-memory op's folder (the op
    DeepSpeed builds on CPU in `init_distributed`) made every later engine wait on it with no limit."""
    root = build_root()
    with exclusive_builds(root):  # placed while no builder runs, as a killed one leaves it
        (root / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
        (root / "deepspeed_shm_comm" / "lock").touch()
    code = textwrap.dedent(
        """
        import torch
        from arpo_core.algorithm.engines import DeepSpeedEngine
        model = torch.nn.Linear(4, 1)
        eng = DeepSpeedEngine(model, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, zero_stage=2)
        eng.backward(model(torch.ones(2, 4)).sum())
        print("stepped", eng.step())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )  # a first build of the op in this venv takes about 30 s here; with the lock it waited for good
    assert out.returncode == 0 and "stepped" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert not (root / "deepspeed_shm_comm" / "lock").exists()
