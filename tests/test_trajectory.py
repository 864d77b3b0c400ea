"""Parquet data contract: exact round trip, atomic writes, schema errors that name the column."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from arpo_core.trajectory import (
    SCHEMA,
    SchemaError,
    Step,
    Trajectory,
    png_bytes,
    read_trajectories,
    write_trajectories,
)

DESIGN_COLUMNS = (
    "run_id stage epoch task_domain task_id group_id sample_idx step_idx instruction screenshot_png "
    "screen_w screen_h response_text actions_json parse_ok done success reward replayed policy_version "
    "gen_logprob_sum env_error"
).split()


def make_traj(n_steps=2, sample_idx=0, color=(255, 0, 0), **kw) -> Trajectory:
    img = Image.new("RGB", (160, 210), color)
    steps = [
        Step(
            step_idx=i,
            screenshot_png=png_bytes(img),
            screen_w=160,
            screen_h=210,
            response_text=f"Thought: step {i} 'quoted' \\ \"x\"\nAction: click(start_box='(10,{i})')",
            actions_json=json.dumps([{"kind": "click", "point": [10, i]}]),
            parse_ok=True,
            done=i == n_steps - 1,
            gen_logprob_sum=-1.5 * i,
            response_token_ids=[1, 2, 3 + i],
        )
        for i in range(n_steps)
    ]
    base = dict(
        run_id="r1",
        stage="train",
        epoch=1,
        task_domain="miniwob",
        task_id="click-test",
        instruction="Click the button.",
        steps=steps,
        group_id=3,
        sample_idx=sample_idx,
        success=1.0,
        reward=1.0,
        replayed=False,
        policy_version=7,
    )
    base.update(kw)
    return Trajectory(**base)


def test_schema_has_design_columns():
    assert set(DESIGN_COLUMNS) <= set(SCHEMA.names)


def test_round_trip_is_exact(tmp_path):
    trajs = [
        make_traj(3, sample_idx=0),
        make_traj(1, sample_idx=1, color=(0, 0, 255), success=0.0, reward=-1.0, replayed=True),
        # identical trajectory fields twice in a row: step_idx 0 must still split them
        make_traj(2, sample_idx=2),
        make_traj(2, sample_idx=2),
    ]
    trajs[1].steps[0].parse_ok = False
    trajs[1].steps[0].env_error = ""
    trajs[2].steps[1].env_error = "browser crashed"
    path = write_trajectories(tmp_path / "a" / "t.parquet", trajs)
    back = read_trajectories(path)
    assert back == trajs
    assert back[0].steps[1].image().size == (160, 210)
    assert back[1].format_error and not back[0].format_error
    assert back[2].env_error == "browser crashed"
    assert back[0].key == ("miniwob", "click-test")


def test_one_row_per_step(tmp_path):
    path = write_trajectories(tmp_path / "t.parquet", [make_traj(3), make_traj(2, sample_idx=1)])
    table = pq.read_table(path)
    assert table.num_rows == 5
    assert table.column("step_idx").to_pylist() == [0, 1, 2, 0, 1]


def test_directory_read_concatenates_in_name_order(tmp_path):
    write_trajectories(tmp_path / "b.parquet", [make_traj(1, sample_idx=1)])
    write_trajectories(tmp_path / "a.parquet", [make_traj(1, sample_idx=0)])
    assert [t.sample_idx for t in read_trajectories(tmp_path)] == [0, 1]


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = write_trajectories(tmp_path / "t.parquet", [make_traj(1)])
    before = path.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(RuntimeError):
        write_trajectories(path, [make_traj(2)])
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temp file left behind


def test_empty_trajectory_rejected(tmp_path):
    with pytest.raises(ValueError, match="has no steps"):
        write_trajectories(tmp_path / "t.parquet", [make_traj(1, steps=[])])


def test_missing_column_is_named(tmp_path):
    path = write_trajectories(tmp_path / "t.parquet", [make_traj(1)])
    table = pq.read_table(path).drop_columns(["reward"])
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(SchemaError, match="missing column 'reward'"):
        read_trajectories(bad)


def test_mistyped_column_is_named(tmp_path):
    path = write_trajectories(tmp_path / "t.parquet", [make_traj(1)])
    table = pq.read_table(path)
    idx = table.schema.get_field_index("epoch")
    table = table.set_column(idx, "epoch", pa.array(["one"], pa.string()))
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(SchemaError, match="column 'epoch' has type string, expected int32"):
        read_trajectories(bad)


def test_train_reply_round_trips_and_old_files_read_as_trained(tmp_path):
    """trajectory.py, decision "Defaulted added columns": `train_reply` is stored per step; a file written
    before the column existed reads with every reply trained, and a mistyped column is still an error."""
    t = make_traj(3)
    t.steps[0].train_reply = False
    path = write_trajectories(tmp_path / "t.parquet", [t, make_traj(1, sample_idx=1)])
    back = read_trajectories(path)
    assert back[0] == t
    assert [s.train_reply for s in back[0].steps] == [False, True, True]
    assert pq.read_table(path).column("train_reply").to_pylist() == [False, True, True, True]
    old = tmp_path / "old.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["train_reply"]), old)
    back_old = read_trajectories(old)
    assert [s.train_reply for tr in back_old for s in tr.steps] == [True] * 4
    assert [tr.with_(steps=[]) for tr in back_old] == [tr.with_(steps=[]) for tr in back]
    table = pq.read_table(path)
    idx = table.schema.get_field_index("train_reply")
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(idx, "train_reply", pa.array([0, 1, 1, 1], pa.int32())), bad)
    with pytest.raises(SchemaError, match="column 'train_reply' has type int32, expected bool"):
        read_trajectories(bad)


def test_missing_file_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trajectory file"):
        read_trajectories(tmp_path / "none.parquet")


def test_png_not_pixels(tmp_path):
    """Screenshots are compressed PNG bytes, not raw pixel arrays (docs/method.md §1 replay memory)."""
    t = make_traj(1)
    data = t.steps[0].screenshot_png
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) < 160 * 210 * 3 / 10
    assert os.path.getsize(write_trajectories(tmp_path / "t.parquet", [t])) < 20_000
