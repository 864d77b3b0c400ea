"""Atomic writes: the old file survives a failing writer, no temp file is left, text/JSON round trip."""

from __future__ import annotations

import json
import os
import stat

import pytest

from arpo_core.infra.fileio import atomic_open, atomic_write_json, atomic_write_text


def test_text_and_json_round_trip(tmp_path):
    p = atomic_write_text(tmp_path / "a" / "b.txt", "héllo\nworld")
    assert p.read_text(encoding="utf-8") == "héllo\nworld"
    q = atomic_write_json(tmp_path / "m.json", {"b": 1, "a": [1.5]}, sort_keys=True)
    assert json.loads(q.read_text()) == {"a": [1.5], "b": 1}
    assert q.read_text().index('"a"') < q.read_text().index('"b"')


def test_failing_writer_keeps_old_file_and_leaves_no_temp(tmp_path):
    p = atomic_write_text(tmp_path / "x.txt", "old")
    with pytest.raises(RuntimeError, match="boom"), atomic_open(p, "w") as f:
        f.write("new, half written")
        raise RuntimeError("boom")
    assert p.read_text() == "old"
    assert [c.name for c in tmp_path.iterdir()] == ["x.txt"]


def test_binary_mode_and_bad_mode(tmp_path):
    with atomic_open(tmp_path / "b.bin") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    with pytest.raises(ValueError, match="writes only"), atomic_open(tmp_path / "c", "ab"):
        pass


# ---- disk full and unwritable outputs (issue 18): a clear message, no temp file, the old file intact

import errno  # noqa: E402

import arpo_core.infra.fileio as fileio  # noqa: E402
from arpo_core.infra.fileio import OutputError, check_space, write_error  # noqa: E402


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_write_names_file_place_and_space(tmp_path, monkeypatch):
    p = atomic_write_text(tmp_path / "sel.json", "old")
    monkeypatch.setattr(fileio.os, "fsync", _enospc)
    with pytest.raises(OutputError) as ei, atomic_open(p, "w") as f:
        f.write("x" * 5000)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC
    assert "disk full while writing sel.json" in msg and str(tmp_path) in msg
    assert " MB free" in msg and "needed" in msg
    assert p.read_text() == "old"
    assert [c.name for c in tmp_path.iterdir()] == ["sel.json"]


def test_errnoless_writer_failure_on_a_full_disk_is_reported_as_disk_full(tmp_path, monkeypatch):
    p = atomic_write_text(tmp_path / "w.bin", "old")
    boom = RuntimeError("basic_ios::clear: iostream error")
    # plenty of space: the writer's own error propagates unchanged
    with pytest.raises(RuntimeError, match="iostream"), atomic_open(p) as f:
        raise boom
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 4096)
    with (
        pytest.raises(OutputError, match=r"disk full while writing w\.bin.*0\.0 MB free"),
        atomic_open(p) as f,
    ):
        f.write(b"y")
        raise boom
    assert p.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_unwritable_output_and_space_check(tmp_path, monkeypatch):
    err = write_error(PermissionError(errno.EACCES, "Permission denied"), "metrics.json", tmp_path)
    assert (
        isinstance(err, OutputError) and "cannot write metrics.json" in str(err) and "permissions" in str(err)
    )
    assert write_error(ValueError("bad"), "x", tmp_path) is None
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 10 << 20)
    check_space(tmp_path, 5 << 20, "a checkpoint")
    with pytest.raises(
        OutputError, match=r"not enough disk space to write a checkpoint .*MB needed, 10.0 MB free"
    ):
        check_space(tmp_path, 20 << 20, "a checkpoint")


class _Saver:
    def __init__(self, size: int = 1000):
        self.size = size

    def save(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "w.bin"), "wb") as f:
            f.write(b"\0" * self.size)


def test_checkpoint_on_a_full_disk_removes_its_temp_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    import arpo_core.algorithm.trainer as trainer

    state = trainer.TrainState(epoch=1, policy_version=1, history=[{"epoch": 1}])
    trainer._save_checkpoint(tmp_path, _Saver(), _Saver(), _Saver(), state)
    ckpts = tmp_path / "checkpoints"
    good = sorted(p.name for p in (ckpts / "epoch-0001").rglob("*"))
    state.epoch = 2

    # 1) the writer fails mid-way with torch's errno-less error on a (nearly) full device
    def torch_save(obj, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 3780480 vs 3780432")

    monkeypatch.setattr(trainer.torch, "save", torch_save)
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 1 << 20)
    monkeypatch.setattr(trainer, "check_space", lambda *a, **k: None)  # let the write start
    with pytest.raises(OutputError) as ei:
        trainer._save_checkpoint(tmp_path, _Saver(), _Saver(), _Saver(), state)
    msg = str(ei.value)
    assert (
        "disk full while writing checkpoint epoch-0002" in msg and str(ckpts) in msg and "1.0 MB free" in msg
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-0001", "latest"]  # no .epoch-0002.tmp
    assert trainer.latest_checkpoint(tmp_path).name == "epoch-0001"
    assert sorted(p.name for p in (ckpts / "epoch-0001").rglob("*")) == good

    # 2) the space check fails before anything is written: the last checkpoint needs more than is free
    monkeypatch.undo()
    monkeypatch.setattr(fileio, "free_bytes", lambda path: 2000)
    with pytest.raises(OutputError, match="not enough disk space to write checkpoint epoch-0002"):
        trainer._save_checkpoint(tmp_path, _Saver(), _Saver(), _Saver(), state)
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-0001", "latest"]

    # 3) ENOSPC from the policy's save: same cleanup, errno kept
    monkeypatch.undo()
    bad = _Saver()
    bad.save = _enospc
    with pytest.raises(OutputError) as ei:
        trainer._save_checkpoint(tmp_path, bad, _Saver(), _Saver(), state)
    assert ei.value.errno == errno.ENOSPC and "checkpoint epoch-0002" in str(ei.value)
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-0001", "latest"]


def test_select_on_a_full_disk_keeps_the_previous_selection(tmp_path, monkeypatch):
    from arpo_core.algorithm.selection import Selection, write_selection

    out = atomic_write_text(tmp_path / "selected_tasks.json", '{"old": true}\n')
    from arpo_core.config import load_params

    sel = Selection(kept=(("d", "t"),), counts={}, params=load_params("params.yaml").select)
    monkeypatch.setattr(fileio.os, "fsync", _enospc)
    with pytest.raises(OutputError, match=r"disk full while writing selected_tasks\.json"):
        write_selection(out, sel)
    assert out.read_text() == '{"old": true}\n'
    assert [c.name for c in tmp_path.iterdir()] == ["selected_tasks.json"]


def test_atomic_writes_get_a_plain_files_mode_not_the_temp_files_0600(tmp_path):
    """mkstemp creates 0600 files; outputs (metrics, viewer pages, Parquet) must be readable like any file."""
    mask = os.umask(0o022)
    os.umask(mask)
    for f in (atomic_write_text(tmp_path / "a.txt", "x"), atomic_write_json(tmp_path / "m.json", {"a": 1})):
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, oct(f.stat().st_mode)
