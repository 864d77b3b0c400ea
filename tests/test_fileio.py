"""Atomic writes: the old file survives a failing writer, no temp file is left, text/JSON round trip."""

from __future__ import annotations

import json

import pytest

from arpo_core.fileio import atomic_open, atomic_write_json, atomic_write_text


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
