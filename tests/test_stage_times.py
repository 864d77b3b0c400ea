"""benchmarks/stage_times.py: per-stage wall times gathered from metrics files in pipeline order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import stage_times  # noqa: E402

from flows.spec import STAGE_NAMES  # noqa: E402


def test_collect_orders_stages_and_names_missing(tmp_path):
    (tmp_path / "sft.json").write_text(json.dumps({"time/sft_s": 121.04, "sft/loss_last": 0.3}))
    (tmp_path / "ground.json").write_text(json.dumps({"time/ground_s": 9.44}))
    (tmp_path / "demos.json").write_text(json.dumps({"demos/episodes": 600.0}))  # no time key
    (tmp_path / "details").mkdir()  # where the runner writes timings now: the summary file has none
    (tmp_path / "train.json").write_text(json.dumps({"rollout/success_rate": 0.3}))
    (tmp_path / "details" / "train.json").write_text(json.dumps({"time/train_s": 50.26}))
    times, missing = stage_times.collect(tmp_path)
    assert list(times) == ["ground", "sft", "train"] and times == {"ground": 9.4, "sft": 121.0, "train": 50.3}
    assert missing == [n for n in STAGE_NAMES if n not in ("ground", "sft", "train")] and "demos" in missing


def test_main_writes_results_with_sizing(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "train.json").write_text(json.dumps({"time/train_s": 165.0}))
    out = tmp_path / "st.json"
    assert stage_times.main(["--metrics", str(tmp_path / "m"), "--preset", "quick",
                             "--out", str(out), "--params", str(ROOT / "params.yaml")]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["stage_s"] == {"train": 165.0} and doc["total_s"] == 165.0
    assert doc["sizing"]["train"]["epochs"] == 1  # the quick preset's
