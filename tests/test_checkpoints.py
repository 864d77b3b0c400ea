"""Checkpoint integrity (issue 34 item 3, trainer.py, decision "Checkpoint integrity"): every checkpoint
carries a manifest and is checked when written and when loaded; a damaged `latest` pointer or newest
checkpoint falls back to the newest good one with a warning naming the file; rotation keeps the last verified
checkpoint; a restart from scratch is said. Real checkpoints of the tiny policy (the trainer harness, ~3 s per
run)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from arpo_core.algorithm import trainer
from arpo_core.algorithm.trainer import CHECKPOINT_MANIFEST, checkpoint_problem, latest_checkpoint
from arpo_core.policy.model import build_tiny_policy

sys.path.insert(0, str(Path(__file__).parent))
import trainer_harness as harness


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(d, size="xs", seed=0)
    return d


@pytest.fixture(scope="module")
def two_epochs(policy_dir, tmp_path_factory):
    """A run directory with the real checkpoints of epochs 1 and 2 (copied per test)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    harness.run(policy_dir, out, *harness.configs(2))
    return out


@pytest.fixture
def run_dir(two_epochs, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_epochs, out)
    trainer._verified.clear()  # a copy is a new directory, but keep tests independent of the cache
    trainer._warned.clear()
    return out


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "arpo.train" and r.levelno >= logging.WARNING]


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_every_checkpoint_has_a_manifest_of_its_files_and_passes(run_dir):
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-0001", "epoch-0002", "latest"]
    for name in ("epoch-0001", "epoch-0002"):
        files = json.loads((ckpts / name / CHECKPOINT_MANIFEST).read_text())["files"]
        on_disk = {
            p.relative_to(ckpts / name).as_posix()
            for p in (ckpts / name).rglob("*")
            if p.is_file() and p.name != CHECKPOINT_MANIFEST
        }
        assert set(files) == on_disk and {"state.json", "rng.pt", "policy/model.safetensors"} <= on_disk
        assert all(v["size"] == (ckpts / name / k).stat().st_size for k, v in files.items())
        assert checkpoint_problem(ckpts / name) is None
    assert latest_checkpoint(run_dir) == ckpts / "epoch-0002"


@pytest.mark.parametrize(
    ("pointer", "what"),
    [
        ("", "is empty"),
        ("\x00\x17garbage", "does not name a checkpoint"),
        ("epoch-0099", "epoch-0099 is missing"),
        (None, "is missing"),
    ],
)
def test_a_bad_pointer_falls_back_to_the_newest_good_checkpoint_and_training_resumes(
    policy_dir, run_dir, caplog, pointer, what
):
    """Before: an empty pointer silently restarted training from epoch 1 (issue 34 item 3)."""
    latest = run_dir / "checkpoints" / "latest"
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    before = json.loads((run_dir / "checkpoints" / "epoch-0002" / "state.json").read_text())["history"]
    with caplog.at_level(logging.WARNING, logger="arpo.train"):
        assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "epoch-0002"
        (line,) = warnings_of(caplog)
        assert str(latest) in line and what in line and "using" in line and "epoch-0002" in line

        seen = []
        state = harness.run(
            policy_dir, run_dir, *harness.configs(3), on_iteration=lambda e, i, m: seen.append(e)
        )
    assert {e for e in seen} == {3}  # only epoch 3 ran: it resumed, not restarted
    assert state.history[:2] == before
    assert latest_checkpoint(run_dir).name == "epoch-0003"
    assert (run_dir / "checkpoints" / "latest").read_text() == "epoch-0003"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(policy_dir, run_dir, caplog, damage):
    """Before: a truncated weights file was loaded, failed three times (Prefect retries) naming no file,
    and the previous epoch's checkpoint, kept for this case, was never used."""
    newest = run_dir / "checkpoints" / "epoch-0002"
    weights = newest / "policy" / "model.safetensors"
    if damage == "truncate":
        truncate(weights, weights.stat().st_size // 2)
        want = "model.safetensors has"
    elif damage == "flip":  # same size, different content: only the hash sees it
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        want = "model.safetensors does not match its sha256"
    elif damage == "delete":
        (newest / "rng.pt").unlink()
        want = "rng.pt is missing"
    else:
        (newest / CHECKPOINT_MANIFEST).write_text("{not json")
        want = f"{CHECKPOINT_MANIFEST} is unreadable"
    with caplog.at_level(logging.WARNING, logger="arpo.train"):
        assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "epoch-0001"
    (line,) = warnings_of(caplog)
    assert want in line and "epoch-0002" in line and "using" in line and "epoch-0001" in line

    seen = []
    state = harness.run(policy_dir, run_dir, *harness.configs(2), on_iteration=lambda e, i, m: seen.append(e))
    assert set(seen) == {2} and state.epoch == 2  # epoch 2 re-run from epoch 1's checkpoint
    assert checkpoint_problem(run_dir / "checkpoints" / "epoch-0002") is None


def test_a_checkpoint_written_before_manifests_still_loads_and_its_truncation_is_found(run_dir, caplog):
    """Older checkpoints have no manifest: the format checks alone (safetensors header vs size, torch zip
    directory, JSON, Parquet footer) accept a whole one and catch a truncated one."""
    ckpts = run_dir / "checkpoints"
    for name in ("epoch-0001", "epoch-0002"):
        (ckpts / name / CHECKPOINT_MANIFEST).unlink()
    assert latest_checkpoint(run_dir) == ckpts / "epoch-0002"
    policy, *_ = trainer._restore_or_start(
        run_dir / "unused", run_dir, harness.configs(2)[0], 3, True, success_threshold=0.1
    )
    assert policy is not None
    for rel in ("policy/model.safetensors", "rng.pt", "engine.pt"):
        f = ckpts / "epoch-0002" / rel
        backup = f.read_bytes()
        truncate(f, len(backup) - 7)
        problem = checkpoint_problem(ckpts / "epoch-0002")
        assert problem is not None and rel.split("/")[-1] in problem and "truncated" in problem, problem
        f.write_bytes(backup)
    assert checkpoint_problem(ckpts / "epoch-0002") is None


def test_no_usable_checkpoint_is_said_before_training_starts_from_epoch_1(policy_dir, run_dir, caplog):
    ckpts = run_dir / "checkpoints"
    for name in ("epoch-0001", "epoch-0002"):
        (ckpts / name / "state.json").write_text("")
    cfg = harness.configs(2)[0]
    with caplog.at_level(logging.WARNING, logger="arpo.train"):
        _, _, _, state, _ = trainer._restore_or_start(
            policy_dir, run_dir, cfg, 3, True, success_threshold=0.1
        )
    assert state.epoch == 0
    lines = warnings_of(caplog)
    assert any(
        "epoch-0002" in ln and "state.json" in ln and "no usable checkpoint is left" in ln for ln in lines
    )
    assert any("training starts again from epoch 1" in ln and str(ckpts) in ln for ln in lines), lines


# ---- writing and rotation, with stand-in savers (no model): what the trainer itself decides


class _Saver:
    def __init__(self, size: int = 1000):
        self.size = size

    def save(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "w.bin"), "wb") as f:
            f.write(b"\0" * self.size)


class _ShortWeights(_Saver):
    """A writer that stops short without an error: a safetensors file whose header describes more data."""

    def save(self, directory):
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "model.safetensors")
        save_file({"w": torch.zeros(256)}, path)
        truncate(Path(path), 600)


def _write(out: Path, epoch: int, policy=None) -> Path:
    state = trainer.TrainState(
        epoch=epoch, policy_version=epoch, history=[{"epoch": e} for e in range(1, epoch + 1)]
    )
    return trainer._save_checkpoint(out, policy or _Saver(), _Saver(), _Saver(), state)


def test_a_checkpoint_that_fails_its_check_after_writing_is_not_published(tmp_path):
    """Before: a writer that stopped short without an error left a checkpoint that `latest` named."""
    _write(tmp_path, 1)
    with pytest.raises(
        RuntimeError,
        match=r"checkpoint epoch-0002 failed its check after writing: .*model\.safetensors is truncated",
    ):
        _write(tmp_path, 2, policy=_ShortWeights())
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-0001", "latest"]  # no temp dir, no epoch-0002
    assert latest_checkpoint(tmp_path) == ckpts / "epoch-0001"


def test_rotation_keeps_the_newest_verified_checkpoint_not_the_two_last_names(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    for e in (1, 2):
        _write(tmp_path, e)
    # epoch 2 is damaged on disk after it was written; epoch 3's rotation must keep epoch 1, the newest
    # checkpoint that still passes (before: it kept epoch-0002 and -0003 and deleted the good one)
    truncate(ckpts / "epoch-0002" / "w.bin", 10)
    trainer._verified.clear()
    _write(tmp_path, 3)
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-0001", "epoch-0003", "latest"]
    # a fresh start (resume off) beside an earlier run's later epochs: before, the rotation kept epochs 7
    # and 8 by name and deleted the epoch-0001 just written, which `latest` then named
    other = tmp_path / "other"
    for e in (7, 8):
        _write(other, e)
    first = _write(other, 1)
    assert first.is_dir() and latest_checkpoint(other) == first
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == ["epoch-0001", "latest"]
