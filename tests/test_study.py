"""arpo_core/analysis/study.py on hand-built evaluations: the hard split, second-half averaging, per-seed
success, and a bootstrap interval that widens with seed-to-seed variance."""

from __future__ import annotations

import pytest
from PIL import Image

from arpo_core.analysis.evaluation import Scorer
from arpo_core.analysis.study import (
    ArmRun,
    arm_success,
    bootstrap_difference,
    hard_split,
    replay_effect,
    second_half,
)
from arpo_core.trajectory import Step, Trajectory, png_bytes

STANDARD = Scorer("standard", 3)
"""Checker success as it is: the scoring of every MiniWoB evaluation here."""


IMG = png_bytes(Image.new("RGB", (8, 8)))


def ep(task: str, k: int, success: float) -> Trajectory:
    step = Step(0, IMG, 8, 8, "Thought: x\nAction: click(start_box='(1,1)')", done=True)
    return Trajectory("r", "train-eval", 0, "miniwob", task, f"do {k}", [step], sample_idx=k, success=success,
                      reward=success)  # fmt: skip


def evals(rates: dict[str, float], n: int = 10) -> list[Trajectory]:
    """n episodes per task, the first round(rate * n) successful."""
    return [ep(task, k, float(k < round(r * n))) for task, r in rates.items() for k in range(n)]


def test_hard_split_by_sampled_base_success():
    base = evals({"a": 0.1, "b": 0.25, "c": 0.6}, n=20)
    hard, control, rates = hard_split(base, 0.25, STANDARD)
    assert hard == ["a", "b"] and control == ["c"] and rates["c"] == pytest.approx(0.6)


def test_second_half_and_arm_success_are_task_and_seed_means():
    runs = [
        ArmRun(
            "arpo_g4",
            0,
            {
                10: evals({"a": 0.0, "b": 0.0}),
                20: evals({"a": 0.4, "b": 0.2}),
                40: evals({"a": 0.6, "b": 0.2}),
            },
        ),
        ArmRun("arpo_g4", 1, {20: evals({"a": 0.2, "b": 0.0}), 40: evals({"a": 0.2, "b": 0.0})}),
    ]
    assert second_half(runs) == [40]
    got = arm_success(runs, ["a", "b"], [20, 40], STANDARD)
    # seed 0: a (0.4+0.6)/2 = 0.5, b 0.2 -> 0.35; seed 1: a 0.2, b 0 -> 0.1
    assert got["seeds"] == pytest.approx({0: 0.35, 1: 0.1})
    assert got["success"] == pytest.approx(0.225)
    assert got["tasks"] == pytest.approx({"a": 0.35, "b": 0.1})


def test_bootstrap_interval_includes_seed_variance():
    same = {"a": 0.5, "b": 0.5}
    grpo = [ArmRun("grpo_g4", s, {10: evals(same, 20)}) for s in range(3)]
    steady = [ArmRun("arpo_g4", s, {10: evals({"a": 0.7, "b": 0.7}, 20)}) for s in range(3)]
    spread = [ArmRun("arpo_g4", s, {10: evals({"a": r, "b": r}, 20)}) for s, r in enumerate((0.4, 0.7, 1.0))]
    a = bootstrap_difference(steady, grpo, ["a", "b"], [10], STANDARD, reps=400)
    b = bootstrap_difference(spread, grpo, ["a", "b"], [10], STANDARD, reps=400)
    assert a["mean"] == pytest.approx(0.2) and b["mean"] == pytest.approx(0.2)
    assert a["ci95"][0] > 0  # identical seeds: only instance noise
    assert (b["ci95"][1] - b["ci95"][0]) > (a["ci95"][1] - a["ci95"][0])  # seeds disagree: wider
    assert a["seeds"] == [3, 3]


def test_replay_effect_document_has_the_required_fields():
    baseline = evals({"a": 0.1, "c": 0.8}, 10)
    base_eval = evals({"a": 0.1, "c": 0.8}, 10)
    runs = [
        ArmRun("arpo_g4", s, {20: evals({"a": 0.5, "c": 0.8})}, [{"replay/groups_filled": 3.0}])
        for s in range(2)
    ]
    runs += [ArmRun("grpo_g4", s, {20: evals({"a": 0.2, "c": 0.8})}) for s in range(2)]
    runs += [ArmRun("grpo_g16", s, {20: evals({"a": 0.9, "c": 0.8})}) for s in range(2)]
    doc = replay_effect(runs, baseline, base_eval, score=STANDARD, reps=200)
    assert doc["hard_tasks"] == ["a"] and doc["base"]["hard"] == pytest.approx(0.1)
    assert doc["arpo"] == {
        "arm": "arpo_g4",
        "hard": pytest.approx(0.5),
        "control": pytest.approx(0.8),
        "seeds": 2,
    }
    assert doc["grpo"]["hard"] == pytest.approx(0.2)
    assert doc["arpo_minus_grpo"]["hard"]["mean"] == pytest.approx(0.3)
    assert doc["arpo_minus_base"]["hard"]["mean"] == pytest.approx(0.4)
    assert doc["arms"]["arpo_g4"]["counts"]["0"]["replay/groups_filled"] == 3.0


def test_tasks_no_arm_trained_are_reported_apart_not_in_the_hard_suite(tmp_path):
    """A task the selection dropped (no baseline success) gets no training in any arm: it must not dilute
    the hard suite (it would add the same near-zero to both arms), and is reported apart."""
    from tracking.study_runs import write_study

    baseline = evals({"a": 0.1, "b": 0.0, "c": 0.8}, 10)
    history = [
        {"task/miniwob/a/episodes": 16.0, "task/miniwob/c/episodes": 16.0, "task/miniwob/b/episodes": 0.0}
    ]
    scores = {"arpo_g4": {"a": 0.5, "b": 0.1, "c": 0.8}, "grpo_g4": {"a": 0.3, "b": 0.0, "c": 0.9}}
    runs = [ArmRun(arm, s, {20: evals(r)}, history) for arm, r in scores.items() for s in range(2)]
    doc = replay_effect(runs, baseline, evals({"a": 0.1, "b": 0.0, "c": 0.8}), score=STANDARD, reps=100)
    assert doc["hard_tasks"] == ["a"] and doc["control_tasks"] == ["c"] and doc["untrained_tasks"] == ["b"]
    assert doc["arpo"]["hard"] == pytest.approx(0.5)  # not (0.5 + 0.1) / 2
    assert doc["arms"]["arpo_g4"]["untrained"] == pytest.approx(0.1) and doc["base"]["untrained"] == 0.0
    assert doc["arpo_minus_grpo"]["hard"]["mean"] == pytest.approx(0.2)
    assert doc["arpo_minus_base"]["hard"]["mean"] == pytest.approx(0.4)
    assert doc["grpo_minus_base"]["hard"]["mean"] == pytest.approx(0.2)
    assert doc["grpo_minus_base"]["control"]["mean"] == pytest.approx(0.1)
    md = write_study(doc, tmp_path / "replay_effect.json")[1].read_text()
    assert "| b | untrained | 0.0 | 0.0 | 10.0 | 0.0 |" in md
    assert "| arpo_g4 - grpo_g4 | +20.0 points [" in md and "| grpo_g4 - base | +20.0 points [" in md
    assert "reported apart: b." in md


def test_click_alignment_of_base_and_arms_and_the_image_blind_ceiling(tmp_path):
    """With DOM targets, the document holds the base's click alignment beside every arm's and the
    image-blind ceiling of the hard and control tasks: here the base clicks one constant point (it hits
    the half of the targets there, like the best constant click) and the arm clicks each target."""
    import json

    from arpo_core.analysis.probe import TargetRecord
    from tracking.study_runs import write_study

    def box(k: int) -> tuple[float, float, float, float]:
        return (0.0, 0.0, 3.0, 3.0) if k % 2 == 0 else (5.0, 5.0, 8.0, 8.0)

    def clicked(task: str, k: int, point: tuple[int, int]) -> Trajectory:
        reply = f"Thought: x\nAction: click(start_box='({point[0]},{point[1]})')"
        step = Step(
            0, IMG, 8, 8, reply, json.dumps([{"action_type": "click", "point": list(point)}]), done=True
        )
        hit = float(box(k)[0] <= point[0] <= box(k)[2] and box(k)[1] <= point[1] <= box(k)[3])
        return Trajectory("r", "train-eval", 0, "miniwob", task, f"do {k}", [step], sample_idx=k, success=hit,
                          reward=hit)  # fmt: skip

    targets = [
        TargetRecord(
            "miniwob",
            task,
            100 + k,
            f"do {k}",
            box(k),
            ((box(k)[0] + box(k)[2]) / 2,) * 2,
            ((box(k)[0] + box(k)[2]) / 2,) * 2,
            "button",
        )
        for task in ("a", "c")
        for k in range(10)
    ]
    base_eval = [clicked(t, k, (1, 1)) for t in ("a", "c") for k in range(10)]
    arm_eval = [clicked(t, k, (1, 1) if k % 2 == 0 else (6, 6)) for t in ("a", "c") for k in range(10)]
    runs = [ArmRun(arm, 0, {20: arm_eval}) for arm in ("arpo_g4", "grpo_g4")]
    doc = replay_effect(
        runs, evals({"a": 0.1, "c": 0.8}), base_eval, score=STANDARD, reps=50, targets=targets, first_seed=100
    )
    assert doc["base"]["click_alignment"]["hit_rate"] == pytest.approx(0.5)
    assert doc["arms"]["arpo_g4"]["click_alignment"]["hit_rate"] == pytest.approx(1.0)
    assert doc["arms"]["arpo_g4"]["click_alignment"]["click_target_corr"] == pytest.approx(1.0)
    assert doc["image_blind"]["hard"]["hit_rate"] == pytest.approx(0.5)
    assert doc["image_blind"]["tasks"] == {"a": pytest.approx(0.5), "c": pytest.approx(0.5)}
    md = write_study(doc, tmp_path / "replay_effect.json")[1].read_text()
    assert "| image-blind first click | - | 50.0 | 50.0 |" in md
    assert "| base | 20 | 50.0 |" in md and "| arpo_g4 | 20 | 100.0 | 1.00 |" in md


def test_study_markdown_has_per_task_per_seed_and_replay_tables(tmp_path):
    from tracking.study_runs import write_study

    baseline = evals({"a": 0.1, "c": 0.8}, 10)
    counts = [  # two epochs; the buffer's counter is a running total
        {"task/miniwob/a/all_fail_groups": 4.0, "task/miniwob/a/replay_fills": 3.0, "train/replayed": 3.0,
         "replay/groups_filled": 3.0},
        {"task/miniwob/a/all_fail_groups": 3.0, "task/miniwob/a/replay_fills": 3.0, "train/replayed": 3.0,
         "replay/groups_filled": 6.0},
    ]  # fmt: skip
    runs = [ArmRun("arpo_g4", s, {20: evals({"a": 0.5, "c": 0.8})}, counts) for s in range(2)]
    runs += [ArmRun("grpo_g4", s, {20: evals({"a": 0.2, "c": 0.8})}) for s in range(2)]
    doc = replay_effect(runs, baseline, baseline, score=STANDARD, reps=50)
    doc["arms"]["arpo_g4"]["click_alignment"] = {"episodes": 20, "hit_rate": 0.25, "click_target_corr": 0.5}
    md = write_study(doc, tmp_path / "replay_effect.json")[1].read_text()
    assert "| a | hard | 10.0 | 10.0 | 50.0 | 20.0 |" in md and "| c | control |" in md
    assert "| arpo_g4 | 1 | 50.0 | 80.0 |" in md and "| grpo_g4 | 0 | 20.0 | 80.0 |" in md
    assert "arpo_g4 seed 0: groups replayed 6; per task all-fail/filled: a 7/6" in md
    assert doc["arms"]["arpo_g4"]["counts"]["0"]["replay/groups_filled"] == 6.0
    assert "| arpo_g4 | 20 | 25.0 | 0.50 | - |" in md and "| grpo_g4 |" not in md.split("Click alignment")[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_arpo_study_reads_two_pipeline_runs_from_mlflow(tmp_path):
    """The study's front door end to end on the quick preset's pinned instances (the paper's protocol):
    two `arpo run`s up to the evaluate stage (ARPO train.seed 0, GRPO train.seed 1, both evaluating
    during training; the study reads no other stage), then `arpo study --preset quick-instances` writes
    replay_instances.json/.md/.png from MLflow; the second run re-runs only the stages a training seed
    reaches. (The family protocol's document, replay_effect, is built by the same gathering; its
    numbers are tested above on hand-built runs.)"""
    import json

    import orchestration_helpers as oh

    project = oh.copy_project(tmp_path / "proj")
    env = oh.base_env(project)
    common = [
        "-S",
        "evaluate.during_training=1",
        "-S",
        "evaluate.during_training_episodes=2",
        "-S",
        "train.epochs=2",
        "-S",
        "evaluate.sampled_temperature=null",  # the study reads the greedy evaluations only
    ]
    arpo = ["-S", "train.seed=0", "-S", "train.replay.preload=baseline"]  # the buffer starts with baseline's
    for extra in (arpo, ["-S", "train.seed=1", "-S", "train.replay.enabled=false"]):
        cmd = ["arpo", "run", "--preset", "quick-instances", *common, *extra, "--target", "evaluate"]
        out = oh.run(cmd, project, env, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "baseline: up to date, skipped" in out.stdout + out.stderr  # the second run's
    assert "sft: up to date, skipped" in out.stdout + out.stderr
    res = oh.run(["arpo", "study", "--preset", "quick-instances", "--out", "study/replay_instances.json",
                  "--reps", "50"], project, env, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((project / "study" / "replay_instances.json").read_text())
    assert set(doc["arms"]) == {"arpo_g2_preload", "grpo_g2"} and doc["protocol"] == "instances"
    assert doc["arms"]["arpo_g2_preload"]["seeds"] == 1 and doc["arms"]["grpo_g2"]["seeds"] == 1
    assert set(doc["arms"]["arpo_g2_preload"]["curve"]["train"]) == {"1", "2"} and doc["epoch_evaluated"] == 2
    assert set(doc["provenance"]["train_runs"]) == {"arpo_g2_preload/seed0", "grpo_g2/seed1"}
    kept = json.loads((project / "data" / "selected_tasks.json").read_text())["kept"]
    assert doc["train_instances"] == sorted(k["task_id"] for k in kept)  # the selection's instances
    assert doc["splits"]["heldout"] == 2  # the two quick families on fresh instances
    assert {"arpo", "grpo", "base", "arpo_minus_grpo", "image_blind"} <= set(doc)
    assert set(doc["arpo_minus_grpo"]) == {"train", "heldout"}
    assert (project / "study" / "replay_instances.png").exists()
    md = (project / "study" / "replay_instances.md").read_text()
    assert "| ARPO (preload) - GRPO | " in md and "| arpo_g2_preload | 1 |" in md


def test_gather_without_baseline_or_evaluate_names_what_is_missing(tmp_path, monkeypatch):
    """A study needs the baseline's rollouts and the base's evaluation: the error says which run is
    missing and how to make it (the arms queued with target `train` alone have neither evaluate run)."""
    from tracking import mlflow_runs
    from tracking.study_runs import gather

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    c = mlflow_runs.client(tmp_path)
    exp = mlflow_runs.ensure_experiment(c, "study", tmp_path)
    mlflow_runs.finish_run(
        c, mlflow_runs.start_run(c, exp, "baseline", tags={"arpo.stage": "baseline"}), ok=True
    )
    with pytest.raises(FileNotFoundError, match=r"no finished evaluate run: .*dvc exp run evaluate"):
        gather("study", root=str(tmp_path))


def test_an_arm_is_named_from_the_runs_logged_method():
    """One method-name rule (pipeline/policies.py `method_name`, logged as the run's `method`): the
    study reads that param instead of re-deriving it from `train.replay.enabled` strings."""
    from tracking.study_runs import _arm

    assert _arm({"method": "arpo", "train.group_size": "8", "train.replay.preload": "none"}) == "arpo_g8"
    assert _arm({"method": "grpo", "train.group_size": "4"}) == "grpo_g4"
    assert (
        _arm({"method": "arpo", "train.group_size": "8", "train.replay.preload": "baseline"})
        == "arpo_g8_preload"
    )
    assert (
        _arm({"method": "arpo_blind", "train.group_size": "8", "train.replay.enabled": "False"})
        == "arpo_g8_blind"
    )


def test_a_study_counts_only_the_runs_of_its_base(tmp_path, monkeypatch):
    """study_runs.py, decision "One base per study": two bases' runs of one suite in one experiment (the
    rare-success study on grounded-xs and on the reader). The baseline and evaluate runs are those of the
    study's base even when the other base's ran later; a base with neither run is a one-line error that
    names it, not a silent mix."""
    import time

    from tracking import mlflow_runs
    from tracking.study_runs import _newest, gather, study_base

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    c = mlflow_runs.client(tmp_path)
    exp = mlflow_runs.ensure_experiment(c, "study", tmp_path)
    suite = "data/suites/miniwob_instances_rare.yaml"
    old, new = "assets/checkpoints/grounded-xs", "assets/checkpoints/grounded-read-xs"
    ids = {}
    for ckpt in (old, new):  # the reader's runs are the newer ones
        for stage in ("baseline", "evaluate"):
            rid = mlflow_runs.start_run(c, exp, stage, tags={"arpo.stage": stage})
            params = {"env.in_domain_suite": suite, "ground.checkpoint": ckpt, "policy.pretrained": None}
            mlflow_runs.log_params(c, rid, params)
            mlflow_runs.finish_run(c, rid, ok=True)
            ids[ckpt, stage] = rid
            time.sleep(0.01)  # start times (ms) in creation order: "newest" is then unambiguous
    xs = study_base({"ground.checkpoint": old, "policy.pretrained": None})
    assert xs == {"ground.checkpoint": old, "policy.pretrained": "null"}
    for stage in ("baseline", "evaluate"):
        assert _newest(c, "study", stage, suite, xs).info.run_id == ids[old, stage]
        assert _newest(c, "study", stage, suite).info.run_id == ids[new, stage]  # no base: the newest
        assert _newest(c, "study", stage, "data/suites/other.yaml", xs) is None
    elsewhere = study_base({"ground.checkpoint": "models/mine", "policy.pretrained": None})
    with pytest.raises(
        FileNotFoundError,
        match=rf"no finished baseline and evaluate run of {suite} from ground.checkpoint=models/mine: ",
    ):
        gather("study", root=str(tmp_path), suite=suite, base=elsewhere)
