"""benchmarks/recorded_runs.py: the JSON plumbing on hand-made inputs, and a tiny real `learning` run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import recorded_runs as rr  # noqa: E402

from arpo_core.envs.base import TaskSpec  # noqa: E402


def test_split_summary_reads_the_evaluate_keys():
    tasks = [TaskSpec(domain="miniwob", task_id="click-test"), TaskSpec(domain="miniwob", task_id="absent")]
    m = {
        "eval/x/in_domain/success_rate": 0.5,
        "eval/x/in_domain/success_ci_low": 0.3,
        "eval/x/in_domain/success_ci_high": 0.7,
        "eval/x/in_domain/episodes": 100.0,
        "eval/x/in_domain/format_error_rate": 0.1,
        "eval/x/all/failed_jobs": 2.0,
        "eval/x/task/miniwob/click-test/success_rate": 0.5,
        "eval/x/task/miniwob/click-test/success_ci_low": 0.3,
        "eval/x/task/miniwob/click-test/success_ci_high": 0.7,
        "eval/x/task/miniwob/click-test/episodes": 50.0,
    }
    s = rr.split_summary(m, "eval/x", "in_domain", tasks)
    assert s["in_domain"] == 0.5 and s["ci95"] == [0.3, 0.7] and s["episodes"] == 100
    assert s["failed_jobs"] == 2 and s["format_error_rate"] == 0.1
    assert s["tasks"] == {"click-test": {"success": 0.5, "ci95": [0.3, 0.7], "episodes": 50}}


def test_epochs_from_history_keeps_probed_epochs_only():
    summary = {
        "in_domain": 0.25,
        "episodes": 100,
        "ci95": [0.1, 0.4],
        "tasks": {"click-test": {"success": 0.5}},
    }
    align = {"pooled": {"click_target_corr": None, "hit_rate": 0.2}}
    probe = rr._probe_metrics(summary, align)
    assert all(isinstance(v, float) for v in probe.values())  # the trainer history is JSON floats
    history = [{"epoch": 1, "loss/policy": 0.1}, {"epoch": 2, **probe}]
    hist = json.loads(json.dumps(history))  # NaN round-trips like the checkpoint's state.json
    assert math.isnan(hist[1]["probe/click_target_corr"])
    (e,) = rr.epochs_from_history(hist)
    assert e["epoch"] == 2 and e["in_domain"] == 0.25 and e["episodes"] == 100
    assert e["click_target_corr"] is None and e["first_click_hit_rate"] == 0.2
    assert e["tasks"] == {"click-test": 0.5} and e["ci95"] == [0.1, 0.4]


@pytest.mark.slow
def test_learning_then_comparison_end_to_end_tiny(tmp_path, monkeypatch):
    """1 epoch of ARPO and GRPO from an untrained xs policy on the quick suite (2 tasks), 2 greedy
    episodes per task per evaluation: learning.json has the format of issue #5; then `comparison` in
    the same work dir reuses both policies and writes issue #8's format."""
    from arpo_core.policy.model import build_tiny_policy

    threads = torch.get_num_threads()
    monkeypatch.chdir(ROOT)
    base = tmp_path / "base"
    build_tiny_policy(base, size="xs", rope_theta=5.0, mrope=[2, 7, 7])
    out = tmp_path / "learning.json"
    sets = [
        "env.n_envs=2",
        "env.in_domain_suite=data/suites/miniwob_quick.yaml",
        "env.out_of_domain_suite=data/suites/miniwob_quick_ood.yaml",
        "rft.sft.steps=2",
        "dpo.steps=2",
        "kto.steps=2",
        "evaluate.episodes_per_task=2",
        "baseline.episodes_per_task=2",
        "select.min_successes=0",
        "train.epochs=1",
        "train.tasks_per_iteration=2",
        "train.group_size=2",
        "train.micro_batch_size=4",
        "train.mini_batch_size=4",
        "policy.max_new_tokens=24",
    ]
    overrides = [x for s in sets for x in ("-S", s)]
    work = ["--base", str(base), "--work", str(tmp_path / "work")]
    try:
        path = rr.main(["learning", *work, "--out", str(out), *overrides])
        cmp_path = rr.main(["comparison", *work, "--out", str(tmp_path / "comparison.json"), *overrides])
    finally:
        torch.set_num_threads(threads)
    assert path == out
    doc = json.loads(out.read_text())
    assert set(doc["base"]) >= {"in_domain", "episodes"} and doc["base"]["episodes"] == 4
    assert 0.0 <= doc["base"]["in_domain"] <= 1.0
    assert 0.0 <= doc["image_blind"]["in_domain"] <= 1.0
    for method in ("arpo", "grpo"):
        epochs = doc[method]["epochs"]
        assert [e["epoch"] for e in epochs] == [0, 1]
        for e in epochs:
            assert set(e) >= {"epoch", "in_domain", "episodes", "click_target_corr"}
            assert e["episodes"] == 4 and 0.0 <= e["in_domain"] <= 1.0
        # the evaluated epoch is paired with the base on the same 4 instances
        vs = epochs[1]["vs_base"]
        assert vs["n"] == 4 and vs["delta"] == pytest.approx(
            epochs[1]["in_domain"] - doc["base"]["in_domain"]
        )
        assert "vs_base" not in epochs[0]
        assert set(epochs[1]["task_click_alignment"]) == set(doc["base"]["task_click_alignment"])
        assert (tmp_path / "work" / method / "policy" / "config.json").exists()
    assert [r["epoch"] for r in doc["arpo_vs_grpo"]] == [1] and doc["arpo_vs_grpo"][0]["n"] == 4
    assert {"targets_in_domain", "evaluate_base", "baseline", "select", "train_arpo", "train_grpo"} <= set(
        doc["wall_s"]
    )
    cmp = json.loads(cmp_path.read_text())
    # the untrained base never succeeds: RFT and DPO have no data and say so; KTO trains on failures
    assert set(cmp["skipped"]) == {"rft", "dpo"}
    for method in ("base", "kto", "grpo", "arpo"):
        assert set(cmp[method]) >= {"in_domain", "out_of_domain", "episodes"}
        assert cmp[method]["episodes"] == 2 * 2 + 1 * 2  # 2 in-domain tasks + 1 out-of-domain, 2 each
        if method != "base":
            assert cmp[method]["vs_base"]["in_domain"]["n"] == 4
            assert cmp[method]["vs_base"]["out_of_domain"]["n"] == 2
    assert {"train_grpo", "train_arpo"}.isdisjoint(cmp["wall_s"])  # reused from the learning run
    md = cmp_path.with_suffix(".md").read_text()
    assert "| arpo |" in md and "image-blind ceiling" in md and "rft: not trained" in md


def test_a_work_dir_serves_one_base_policy(tmp_path):
    from types import SimpleNamespace

    a, b = tmp_path / "a", tmp_path / "b"
    for d, content in ((a, "1"), (b, "22")):
        d.mkdir()
        (d / "config.json").write_text(content)
    run = SimpleNamespace(work=tmp_path / "work")
    run.work.mkdir()
    rr.bind_base(run, a)
    rr.bind_base(run, a)  # the same base again: fine
    with pytest.raises(SystemExit, match="another"):
        rr.bind_base(run, b)
    (a / "config.json").write_text("333")  # the base changed in place
    with pytest.raises(SystemExit):
        rr.bind_base(run, a)
