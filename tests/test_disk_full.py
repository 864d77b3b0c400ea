"""Disk full, one writer kind at a time (issue 32 item 4): every stage output reports it as train's
checkpoint does (fileio.py, decision "Clear output errors"): one line saying what, where, about how many MB it
needed and how many are free, and that the previous output is intact (it is: stages write to staging paths,
flows/runner.py, decision "Staged outputs"). Copies of the versioned checkpoint (ground), Parquet trajectory
files and policy saves; JSON/text and checkpoints are in tests/test_fileio.py. ENOSPC is simulated by making
the writing call raise it; as root, one case also runs on a real 1 MB tmpfs mounted over models/."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import orchestration_helpers as oh

import arpo_core.infra.fileio as fileio
from arpo_core.infra.errors import retryable
from arpo_core.infra.fileio import OutputError

GROUND = ["ground.eval_miniwob_seeds=0"]  # no browser: the copy is what is tested
MESSAGE_END = "the previous output is intact)"


def snapshot(path: Path) -> dict[str, str]:
    return {
        f.relative_to(path).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def one_line(e: BaseException) -> str:
    """The message (without OSError's "[Errno 28] " prefix), asserted to be one line of a non-retryable
    OutputError."""
    assert isinstance(e, OutputError) and not retryable(e), repr(e)
    msg = e.strerror
    assert "\n" not in msg, msg
    return msg


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(oh.copy_project(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def _previous_grounded() -> tuple[Path, dict[str, str]]:
    out = Path("models/grounded")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text('{"previous": true}')
    return out, snapshot(out)


def _ground() -> None:
    """The ground stage as the runner calls it: its output is the staging path beside models/grounded
    (that the runner then leaves the previous output alone is tests/test_stage_outputs.py's)."""
    from arpo_core.config import load_params
    from arpo_core.pipeline import ground
    from flows.runner import staging_path

    p = load_params("params.yaml", GROUND, preset="quick")
    ground.run(p, Path("models/init"), staging_path(Path("models/grounded")))


def test_ground_copying_the_versioned_checkpoint_on_a_full_disk_is_one_line(project, monkeypatch):
    """Before: a Python list of shutil error tuples, one per file, and 0-byte and truncated files left in
    models/grounded (the copy went straight into it)."""
    from arpo_core.config import load_params

    out, before = _previous_grounded()
    start = Path(load_params("params.yaml", GROUND, preset="quick").ground.checkpoint)  # what _ground copies

    real_copy2 = fileio.shutil.copy2
    copied = []

    def copy2_then_full(src, dst, **kw):
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        copied.append(real_copy2(src, dst, **kw))

    monkeypatch.setattr(fileio.shutil, "copy2", copy2_then_full)
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 200 << 20)  # the space check passes
    with pytest.raises(OutputError) as e:
        _ground()
    msg = one_line(e.value)
    assert msg.startswith(
        f"disk full while writing the grounded policy (a copy of {start}) to models/.grounded.staging"
    )
    need = f"{fileio.tree_size(start) / 2**20:.1f} MB needed"
    assert "200.0 MB free, about " + need in msg and MESSAGE_END in msg, msg
    assert snapshot(out) == before

    # the space check: nothing is written when the checkpoint does not fit
    copied.clear()
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(OutputError) as e:
        _ground()
    msg = one_line(e.value)
    assert msg.startswith(f"not enough disk space to write the grounded policy (a copy of {start})"), msg
    assert "MB needed, 1.0 MB free (nothing was written; the previous output is intact)" in msg
    assert not copied and snapshot(out) == before


@pytest.fixture
def small_models(project):
    """models/ on a real 1 MB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    models = project / "models"
    models.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(models)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield models
    subprocess.run(["umount", "-l", str(models)], check=True)


def test_ground_on_a_real_full_tmpfs(small_models, monkeypatch):
    out, before = _previous_grounded()
    with pytest.raises(OutputError, match="not enough disk space to write the grounded policy") as e:
        _ground()
    one_line(e.value)
    monkeypatch.setattr(fileio, "check_space", lambda *a, **k: None)  # let the copy meet the full disk
    with pytest.raises(OutputError) as e:
        _ground()
    msg = one_line(e.value)
    assert msg.startswith("disk full while writing the grounded policy") and "No space left" in msg, msg
    assert e.value.errno == errno.ENOSPC and MESSAGE_END in msg
    assert snapshot(out) == before


class _FullAfter(io.RawIOBase):
    """The file a writer gets, whose writes fail like a full device's."""

    def __init__(self, f):
        self.f = f

    def writable(self):
        return True

    def write(self, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()
        super().close()


def test_parquet_trajectories_on_a_full_disk(tmp_path, monkeypatch):
    """Before: nothing written yet, so the message had no size (`needed` came from the temp file)."""
    from arpo_core.trajectory import Step, Trajectory, write_trajectories

    path = tmp_path / "demos.parquet"
    path.write_bytes(b"previous")
    step = Step(
        step_idx=0, screenshot_png=b"\x89PNG" * 100_000, screen_w=160, screen_h=210, response_text="r"
    )
    trajs = [Trajectory("r", "demos", 0, "miniwob", "click-test", "i", [step])]
    real_fdopen = fileio.os.fdopen
    monkeypatch.setattr(fileio.os, "fdopen", lambda fd, mode, **kw: _FullAfter(real_fdopen(fd, mode, **kw)))
    with pytest.raises(OutputError) as e:
        write_trajectories(path, trajs)
    msg = one_line(e.value)
    assert msg.startswith(f"disk full while writing demos.parquet to {tmp_path}: ")
    assert "about 0.4 MB needed" in msg and MESSAGE_END in msg, msg
    assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == [
        "demos.parquet"
    ]


def test_policy_save_on_a_full_disk(tmp_path, monkeypatch):
    """Before: safetensors' `SafetensorError: Error while serializing: I/O error: No space left on device
    (os error 28)` (no errno, no place, no sizes), and no space check before writing."""
    import transformers.modeling_utils as mu

    from arpo_core.policy.model import build_tiny_policy

    policy = build_tiny_policy(tmp_path / "init", size="xs", seed=0)
    weights = (tmp_path / "init" / "model.safetensors").stat().st_size

    def safetensors_full(*a, **k):  # what the Rust writer raises on ENOSPC (seen on a real tmpfs)
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", safetensors_full)
    with pytest.raises(OutputError) as e:
        policy.save(tmp_path / "base")
    msg = one_line(e.value)
    assert e.value.errno == errno.ENOSPC
    assert msg.startswith(f"disk full while writing policy to {tmp_path / 'base'}: ") and "MB needed" in msg
    assert MESSAGE_END in msg, msg
    monkeypatch.undo()
    monkeypatch.setattr(fileio, "free_bytes", lambda path: weights // 2)
    with pytest.raises(OutputError, match=r"not enough disk space to write policy to .*MB needed") as e:
        policy.save(tmp_path / "sft")
    assert not (tmp_path / "sft").exists()  # checked before anything was written
