"""The compare stage on fabricated evaluation episodes (no browser: compare.image_blind=false); the
image-blind ceiling from real DOM targets runs in the pipeline tests (quick preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from arpo_core.config import load_params
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.pipeline import compare
from arpo_core.pipeline.offline_baselines import SKIPPED
from arpo_core.trajectory import Step, Trajectory, png_bytes, write_trajectories

ROOT = Path(__file__).resolve().parents[1]
IN, OUT = "click-test", "click-test-transfer"  # the quick suites' tasks (in-domain, out-of-domain)


def params(*overrides):
    return load_params(ROOT / "params.yaml", ["compare.image_blind=false", *overrides], preset="quick")


def episodes(method: str, wins: dict[str, list[int]]) -> list[Trajectory]:
    """One episode per (task, k); success where k is listed in wins[task]."""
    img = png_bytes(Image.new("RGB", (160, 210)))
    out = []
    for task, ks in wins.items():
        for k in range(4):
            step = Step(0, img, 160, 210, "Thought: x\nAction: click(start_box='(5,5)')", done=True)
            s = float(k in ks)
            out.append(Trajectory(f"evaluate-{method}", "evaluate", 0, "miniwob", task, f"Click {k}.", [step],
                                  group_id=0, sample_idx=k, success=s, reward=s))  # fmt: skip
    return out


@pytest.fixture
def evals(tmp_path):
    d = tmp_path / "data"
    write_trajectories(d / "eval" / "base.parquet", episodes("base", {IN: [0], OUT: []}))
    write_trajectories(d / "eval" / "arpo.parquet", episodes("arpo", {IN: [0, 1, 2], OUT: [3]}))
    write_trajectories(d / "eval" / "arpo-sampled.parquet", episodes("arpo", {IN: [], OUT: []}))
    write_trajectories(d / "eval_kto" / "kto.parquet", episodes("kto", {IN: [1], OUT: []}))
    (d / "eval_rft").mkdir()
    atomic_write_json(tmp_path / "models" / "rft" / SKIPPED, {"method": "rft", "reason": "no success"})
    return tmp_path


def test_collect_orders_methods_and_ignores_sampled(evals):
    got = compare.collect_evaluations(
        [evals / "data" / "eval", evals / "data" / "eval_kto", evals / "nothing"]
    )
    assert list(got) == ["base", "kto", "arpo"]
    assert len(got["arpo"]) == 8


def test_compare_writes_table_json_plot_with_paired_deltas(evals):
    dirs = [evals / "data" / n for n in ("eval", "eval_rft", "eval_kto")]
    m = compare.run(params(), dirs, [evals / "models" / "rft"], evals / "report")
    doc = json.loads((evals / "report" / "comparison.json").read_text())
    assert list(doc["methods"]) == ["base", "kto", "arpo"]
    arpo = doc["methods"]["arpo"]
    assert arpo["in_domain"]["success"] == pytest.approx(0.75) and arpo["in_domain"]["episodes"] == 4
    vs = arpo["in_domain"]["vs_reference"]
    assert vs["n"] == 4 and vs["delta"] == pytest.approx(0.5) and vs["wins"] == 2 and vs["losses"] == 0
    assert arpo["out_of_domain"]["vs_reference"]["delta"] == pytest.approx(0.25)
    assert "vs_reference" not in doc["methods"]["base"]["in_domain"]
    assert doc["not_trained"] == {"rft": "no success"}
    assert doc["image_blind"]["in_domain"] is None  # switched off: no browser
    assert m["compare/arpo/in_domain/delta_vs_base"] == pytest.approx(0.5)
    assert m["compare/kto/in_domain/success_rate"] == pytest.approx(0.25) and m["compare/methods"] == 3.0
    md = (evals / "report" / "comparison.md").read_text()
    assert "| arpo | 75.0 |" in md and "+50.0" in md and "rft: not trained (no success)" in md
    assert (evals / "report" / "comparison.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_scores_episodes_as_the_evaluation_did(tmp_path):
    """With `evaluate.osworld_hard` the compare stage's rates and paired deltas use the OSWorld-Hard rule
    at `evaluate.max_steps` (evaluation.Scorer.of), as the evaluate stage did: before, it always scored
    the checker's success, so its table disagreed with the evaluate stage's numbers."""
    import json as _json

    img = png_bytes(Image.new("RGB", (160, 210)))

    def gave_up(method: str, k: int) -> Trajectory:  # success 1, but the limit hit and the last action FAIL
        steps = [
            Step(i, img, 160, 210, "Thought: x\nAction: click(start_box='(5,5)')",
                 actions_json=_json.dumps([{"kind": "call_user" if i == 2 else "click", "point": [5, 5]}]))
            for i in range(3)
        ]  # fmt: skip
        return Trajectory(f"evaluate-{method}", "evaluate", 0, "miniwob", IN, f"Click {k}.", steps,
                          sample_idx=k, success=1.0, reward=1.0)  # fmt: skip

    d = tmp_path / "data" / "eval"
    write_trajectories(d / "base.parquet", episodes("base", {IN: [0]}))
    write_trajectories(d / "arpo.parquet", [gave_up("arpo", k) for k in range(4)])
    base = "env.out_of_domain_suite=null"
    standard = compare.run(params(base), [d], [], tmp_path / "standard")
    hard = compare.run(
        params(base, "evaluate.osworld_hard=true", "evaluate.max_steps=3"), [d], [], tmp_path / "hard"
    )
    assert standard["compare/arpo/in_domain/success_rate"] == pytest.approx(1.0)
    assert standard["compare/arpo/in_domain/delta_vs_base"] == pytest.approx(0.75)
    assert hard["compare/arpo/in_domain/success_rate"] == 0.0
    assert hard["compare/arpo/in_domain/delta_vs_base"] == pytest.approx(-0.25)


def test_compare_names_a_missing_reference(evals):
    with pytest.raises(FileNotFoundError, match=r"compare\.reference='dpo'.*evaluated: base, arpo"):
        compare.run(params("compare.reference=dpo"), [evals / "data" / "eval"], [], evals / "report")


def test_compare_without_a_held_out_suite(tmp_path):
    """env.out_of_domain_suite: null (train and evaluate on the same tasks): no out-of-domain split in the
    document, the metrics or the table (not an error)."""
    d = tmp_path / "data" / "eval"
    write_trajectories(d / "base.parquet", episodes("base", {IN: [0]}))
    write_trajectories(d / "arpo.parquet", episodes("arpo", {IN: [0, 1]}))
    m = compare.run(params("env.out_of_domain_suite=null"), [d], [], tmp_path / "report")
    doc = json.loads((tmp_path / "report" / "comparison.json").read_text())
    arpo = doc["methods"]["arpo"]
    assert arpo["in_domain"]["vs_reference"]["delta"] == pytest.approx(0.25)
    assert "out_of_domain" not in arpo and doc["splits"] == ["in_domain"]
    assert not any("out_of_domain" in k for k in m)
    md = (tmp_path / "report" / "comparison.md").read_text()
    assert "| arpo | 50.0 |" in md and "out-of-domain" not in md


def test_compare_reports_the_tasks_training_reached(tmp_path):
    """compare.py, decision "Trained-task view": with training rollouts on click-test only, each method also
    gets a `trained` cell on click-test alone (rate, interval, paired delta), apart from the whole in-domain
    suite's."""
    d = tmp_path / "data" / "eval"
    write_trajectories(d / "base.parquet", episodes("base", {IN: [0], "click-button": [0, 1]}))
    write_trajectories(d / "arpo.parquet", episodes("arpo", {IN: [0, 1, 2, 3], "click-button": [0]}))
    train = tmp_path / "models" / "arpo"
    write_trajectories(train / "trajectories" / "epoch-0001-iter-000.parquet", episodes("train", {IN: [0]}))
    m = compare.run(params(), [d], [], tmp_path / "report", train_dir=train)
    doc = json.loads((tmp_path / "report" / "comparison.json").read_text())
    assert doc["trained_tasks"] == [IN]
    arpo = doc["methods"]["arpo"]
    assert arpo["in_domain"]["vs_reference"]["delta"] == pytest.approx(0.25)  # (4 + 1 - 1 - 2) / 8
    assert arpo["trained"]["success"] == pytest.approx(1.0) and arpo["trained"]["episodes"] == 4
    assert (
        arpo["trained"]["vs_reference"]["delta"] == pytest.approx(0.75)
        and arpo["trained"]["vs_reference"]["wins"] == 3
    )
    assert "vs_reference" not in doc["methods"]["base"]["trained"]
    assert m["compare/arpo/trained/delta_vs_base"] == pytest.approx(0.75)
    md = (tmp_path / "report" / "comparison.md").read_text()
    assert "## Where training reached (1 of 2 in-domain tasks)" in md and "| arpo | 100.0 |" in md
    # no training rollouts stored: no cell, no section
    compare.run(params(), [d], [], tmp_path / "report2", train_dir=tmp_path / "none")
    doc2 = json.loads((tmp_path / "report2" / "comparison.json").read_text())
    assert doc2["trained_tasks"] == [] and "trained" not in doc2["methods"]["arpo"]
    assert "Where training reached" not in (tmp_path / "report2" / "comparison.md").read_text()
