"""The paper's protocol on the embedded default (issue 29): suites that pin task instances, each instance
a task of its own through the job builders, selection, evaluation splits, replay preload and the
image-blind arm; instances of demos, training and evaluation disjoint; the study document."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from arpo_core.algorithm.replay import ReplayConfig
from arpo_core.algorithm.rollout import EpisodeJob, make_group_jobs
from arpo_core.analysis.evaluation import Scorer, eval_jobs
from arpo_core.config import ConfigError, load_params
from arpo_core.config.suites import SuiteError, TaskSpec, families, load_suite
from arpo_core.infra.seeds import derive_seed
from arpo_core.pipeline.baseline import baseline_jobs
from arpo_core.pipeline.common import evaluation_tasks, instance_episodes, suite_tasks
from arpo_core.pipeline.demos import demo_jobs
from arpo_core.policy.prompt import PromptSpec
from arpo_core.trajectory import Step, Trajectory, png_bytes, read_trajectories

sys.path.insert(0, str(Path(__file__).parent))
import trainer_harness as harness

STANDARD = Scorer("standard", 3)
"""Checker success as it is: the scoring of every MiniWoB evaluation here."""


ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "presets").glob("*.yaml"))


def write(tmp_path: Path, body: str, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(body)
    return p


# ---------------------------------------------------------------------------------------------------
# The suite format


def test_instances_pin_seeds_derived_from_suite_task_and_index(tmp_path):
    p = write(
        tmp_path,
        "name: demo\ninstances: 3\ntasks:\n  - click-link\n  - {task_id: click-button, instances: 2}\n",
    )
    specs = load_suite(p)
    assert [t.task_id for t in specs] == [
        "click-link@0000", "click-link@0001", "click-link@0002", "click-button@0000", "click-button@0001"
    ]  # fmt: skip
    assert specs[1].seed == derive_seed("instance", "demo", "miniwob", "click-link", 1, bits=40)
    assert specs[3].seed != specs[0].seed  # another task, another instance
    assert all(t.pinned and t.family in ("click-link", "click-button") for t in specs)
    assert specs[0].key == ("miniwob", "click-link@0000")
    assert load_suite(p) == specs  # stable
    renamed = write(tmp_path, p.read_text().replace("name: demo", "name: other"), "t.yaml")
    assert load_suite(renamed)[0].seed != specs[0].seed  # the suite's name is part of the seed


def test_explicit_seeds_and_families(tmp_path):
    p = write(tmp_path, "tasks:\n  - {task_id: click-test, seeds: [7, 12]}\n  - focus-text\n")
    specs = load_suite(p)
    assert [(t.task_id, t.seed) for t in specs] == [
        ("click-test@s7", 7),
        ("click-test@s12", 12),
        ("focus-text", None),
    ]
    assert [t.task_id for t in families(specs)] == ["click-test", "focus-text"]
    assert families(specs)[0] == TaskSpec("miniwob", "click-test")


BROKEN = [
    ("tasks:\n  - click-test\n  - [a\n", r"s\.yaml:4:1: YAML syntax error"),
    ("domain: miniwob\ntasks: []\n", r"s\.yaml:2: the suite lists no tasks"),
    ("tasks: [click-test, click-test]\n", r"s\.yaml:1: duplicate task miniwob/click-test"),
    ("tasks:\n  - {task_id: click-test, colour: 1}\n", r"s\.yaml:2: task #0: unknown key\(s\) \['colour'\]"),
    ("hello\n", r"s\.yaml: a suite is a mapping"),
    ("bogus: 1\ntasks: [click-test]\n", r"s\.yaml:1: unknown suite key\(s\) \['bogus'\]"),
    (
        "tasks:\n  - {task_id: click-test, instances: 2, seeds: [1]}\n",
        r"s\.yaml:2: task click-test: give instances or seeds",
    ),
    ("tasks:\n  - {task_id: click-test, instances: 0}\n", r"instances must be an integer in \[1, 100000\]"),
    ("tasks:\n  - {task_id: click-test, seeds: [3, 3]}\n", r"seeds lists a seed twice"),
    ("tasks:\n  - {task_id: click-test@3}\n", r"without '@'"),
]


@pytest.mark.parametrize(("body", "message"), BROKEN)
def test_every_suite_problem_is_one_line_naming_the_file(tmp_path, body, message):
    p = write(tmp_path, body)
    with pytest.raises(SuiteError, match=message) as e:
        load_suite(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)
    # ... and params refuse the suite when they load (arpo params / run / stage, DVC, Prefect all load them)
    with pytest.raises(ConfigError, match=f"env.in_domain_suite = .* is not a usable suite: .*{message}"):
        load_params(ROOT / "params.yaml", [f"env.in_domain_suite={p}"])


@pytest.mark.parametrize(("body", "message"), BROKEN[:5])
def test_arpo_params_fails_in_one_line_on_a_broken_suite(tmp_path, body, message):
    p = write(tmp_path, body)
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "arpo"), "params", "-S", f"env.in_domain_suite={p}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert str(p) in lines[0] and "not a usable suite" in lines[0]


# ---------------------------------------------------------------------------------------------------
# Every job of a pinned instance plays the instance


def test_a_pinned_task_plays_its_own_seed_in_every_job_builder():
    t = TaskSpec("miniwob", "click-link@0003", seed=12345)
    assert EpisodeJob(t, seed=99).seed == 12345
    assert {j.seed for j in make_group_jobs([t], 4, seed=5, groups_per_task=2)} == {12345}
    assert {j.seed for j in eval_jobs([t], 50, seed=900000, instance_episodes=3)} == {12345}
    assert len(eval_jobs([t, TaskSpec("miniwob", "click-link")], 5, seed=900000, instance_episodes=3)) == 8
    fam = TaskSpec("miniwob", "click-link")
    assert [j.seed for j in eval_jobs([fam], 3, seed=10)] == [10, 11, 12]


def test_quick_instances_splits_and_episode_counts():
    p = load_params(ROOT / "params.yaml", preset="quick-instances")
    tasks = suite_tasks(p, "in_domain")
    assert len(tasks) == 4 and all(t.pinned for t in tasks)
    ev = evaluation_tasks(p, tasks[:3])  # the train stage trains on 3 of them (a selection)
    assert [(t.task_id, t.split) for t in ev if t.split != "out_of_domain"] == [
        *((t.task_id, "train") for t in tasks[:3]),
        ("click-test", "heldout"),
        ("click-button", "heldout"),
    ]
    assert {t.split for t in ev} == {"train", "heldout", "out_of_domain"}
    assert instance_episodes(p, 0.0) == 1 and instance_episodes(p, 0.6) == p.evaluate.samples_per_instance
    # baseline: N rollouts of each instance on itself (the paper's selection input)
    jobs = baseline_jobs(p)
    assert len(jobs) == 4 * p.baseline.episodes_per_task and {j.seed for j in jobs} == {t.seed for t in tasks}
    # demos: the families, on their own seeds
    assert {j.task.task_id for j in demo_jobs(p)} == {"click-test", "click-button"}


def _played(p) -> dict[str, dict[tuple[str, str], set[int]]]:
    """Per role, {(domain, family): env seeds} as the stages' own job builders play them."""
    out: dict[str, dict[tuple[str, str], set[int]]] = {}

    def add(role: str, jobs) -> None:
        for j in jobs:
            out.setdefault(role, {}).setdefault((j.task.domain, j.task.family), set()).add(j.seed)

    ind = suite_tasks(p, "in_domain")
    add("demos", demo_jobs(p))
    add("train", [j for j in baseline_jobs(p) if j.task.pinned])
    add("train", make_group_jobs(ind, p.train.group_size, seed=1, groups_per_task=p.train.groups_per_task))
    e = p.evaluate
    n = max(e.episodes_per_task, e.during_training_episodes)
    ev = evaluation_tasks(p, ind)
    add("heldout", eval_jobs([t for t in ev if t.split in ("heldout", "in_domain")], n, e.seed))
    add(
        "out_of_domain", eval_jobs([t for t in ev if t.split == "out_of_domain"], e.episodes_per_task, e.seed)
    )
    if not any(t.pinned for t in ind):
        out.pop("train", None)  # family training groups draw fresh derived seeds: no fixed set to compare
    return out


@pytest.mark.parametrize("preset", [None, *[p for p in PRESETS if p not in ("osworld-local", "paper")]])
def test_demo_training_heldout_and_ood_instances_are_disjoint(preset):
    p = load_params(ROOT / "params.yaml", preset=preset)
    roles = _played(p)
    names = sorted(roles)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for fam in set(roles[a]) & set(roles[b]):
                assert not roles[a][fam] & roles[b][fam], (preset, a, b, fam)
    if preset in ("replay-instances", "quick-instances"):
        assert set(roles) == {"demos", "train", "heldout", "out_of_domain"}


def test_params_refuse_a_pinned_seed_that_demos_also_play(tmp_path):
    p = write(tmp_path, "tasks:\n  - {task_id: click-test, seeds: [100003]}\n")
    with pytest.raises(
        ConfigError, match=r"click-test plays env seed 100003 as demos and as train instances"
    ):
        load_params(ROOT / "params.yaml", [f"env.in_domain_suite={p}"])


@pytest.mark.slow
def test_a_pinned_instance_is_the_same_screen_whatever_seed_is_proposed():
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv

    t = TaskSpec("miniwob", "click-link@s4242", seed=4242)
    env = MiniWoBEnv()
    try:
        a = env.reset(t, seed=1)
        b = env.reset(t, seed=2)
        c = env.reset(TaskSpec("miniwob", "click-link"), seed=4242)
        d = env.reset(TaskSpec("miniwob", "click-link"), seed=4243)
    finally:
        env.close()
    assert (
        a.instruction == b.instruction == c.instruction and a.screenshot.tobytes() == c.screenshot.tobytes()
    )
    assert d.instruction != a.instruction or d.screenshot.tobytes() != a.screenshot.tobytes()


# ---------------------------------------------------------------------------------------------------
# Preload and the image-blind arm through the real trainer


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from arpo_core.policy.model import build_tiny_policy

    d = tmp_path_factory.mktemp("tiny")
    build_tiny_policy(d, size="xs", seed=0)
    return d


def _success(task: str, x: int) -> Trajectory:
    img = png_bytes(Image.new("RGB", harness.SCREEN, (3, 10, 10)))
    reply = f"Thought: try {x}.\nAction: click(start_box='({x},100)')"
    step = Step(0, img, *harness.SCREEN, response_text=reply, actions_json="[]", done=True)
    return Trajectory(
        "baseline", "baseline", 0, "fake", task, f"Click for {task}", [step], success=1.0, reward=1.0
    )


def test_preload_fills_an_all_failed_group_from_the_first_iteration(policy_dir, tmp_path):
    """The harness's epoch 1 fails every group (test_trainer.PINNED); with the baseline's success of
    'hard' preloaded, its all-failed group is filled at once; a success of a task not trained is not
    stored, and a failure is not either."""
    torch.set_num_threads(1)
    pre = [
        _success("hard", 10),
        _success("elsewhere", 10),
        replace(_success("never", 10), success=0.0, reward=0.0),
    ]
    cfg, pc = harness.configs(1, replay=ReplayConfig(capacity_per_task=3, preload="baseline"))
    state = harness.run(policy_dir, tmp_path, cfg, pc, preload=pre)
    h = state.history[0]
    assert h["task/fake/hard/replay_fills"] == 1.0 and h["task/fake/never/replay_fills"] == 0.0
    replayed = [
        t
        for f in sorted((tmp_path / "trajectories").glob("*.parquet"))
        for t in read_trajectories(f)
        if t.replayed
    ]
    assert [(t.task_id, t.steps[0].response_text) for t in replayed] == [
        ("hard", pre[0].steps[0].response_text)
    ]
    # without preload the same run fills nothing in epoch 1
    cfg0, _ = harness.configs(1, replay=ReplayConfig(capacity_per_task=3))
    plain = harness.run(policy_dir, tmp_path / "plain", cfg0, pc, preload=pre)  # preload given, option off
    assert plain.history[0]["task/fake/hard/replay_fills"] == 0.0


def test_the_image_blind_policy_sees_blank_screens_of_the_same_size(policy_dir):
    from arpo_core.policy.model import load_policy
    from arpo_core.policy.prompt import build_segments
    from arpo_core.policy.sequences import encode_segments

    policy = load_policy(policy_dir)
    segs = build_segments("Click the link", 1, [], spec=PromptSpec("compact", 1))
    red, blue = Image.new("RGB", (160, 210), "red"), Image.new("RGB", (160, 210), "blue")
    seen = (
        encode_segments(policy, segs, [red]).pixel_values,
        encode_segments(policy, segs, [blue]).pixel_values,
    )
    assert not torch.equal(*seen)
    policy.image_blind = True
    blind = encode_segments(policy, segs, [red]), encode_segments(policy, segs, [blue])
    assert torch.equal(blind[0].pixel_values, blind[1].pixel_values)
    assert (
        blind[0].input_ids == encode_segments(load_policy(policy_dir), segs, [red]).input_ids
    )  # same tokens
    white = encode_segments(load_policy(policy_dir), segs, [Image.new("RGB", (160, 210), "white")])
    assert torch.equal(blind[0].pixel_values, white.pixel_values)


def test_train_image_blind_marks_the_trained_policy(policy_dir, tmp_path):
    from arpo_core.algorithm.trainer import _restore_or_start

    cfg, _ = harness.configs(1, image_blind=True)
    policy, *_ = _restore_or_start(policy_dir, tmp_path, cfg, seed=0, resume=False, success_threshold=0.1)
    assert policy.image_blind
    cfg, _ = harness.configs(1)
    assert not _restore_or_start(policy_dir, tmp_path, cfg, seed=0, resume=False, success_threshold=0.1)[
        0
    ].image_blind


# ---------------------------------------------------------------------------------------------------
# The study document


def _ep(task: str, k: int, success: float) -> Trajectory:
    step = Step(0, b"", 160, 210, response_text="r")
    return Trajectory("r", "train-eval", 0, "miniwob", task, "i", [step], sample_idx=k, success=success)


def test_instance_effect_by_split_with_hand_computed_values():
    from arpo_core.analysis.study import ArmRun, instance_effect

    train = ["a@0000", "a@0001", "b@0000", "b@0001"]

    def evals(train_wins: list[float], heldout: list[float]) -> dict[int, list[Trajectory]]:
        eps = [_ep(t, 0, s) for t, s in zip(train, train_wins, strict=True)]
        eps += [_ep("a", k, s) for k, s in enumerate(heldout)]
        return {5: eps[:1], 10: eps}

    runs = [
        ArmRun("arpo_g8", 0, evals([1, 1, 1, 0], [1, 0])),
        ArmRun("arpo_g8", 1, evals([1, 1, 0, 0], [0, 0])),
        ArmRun("grpo_g8", 0, evals([1, 0, 0, 0], [1, 0])),
        ArmRun(
            "arpo_g8_blind",
            0,
            evals([1, 1, 0, 1], [0, 0]),
            history=[{"task/miniwob/a_0000/all_fail_groups": 2.0, "task/miniwob/a_0000/replay_fills": 1.0}],
        ),
    ]
    base = [_ep(t, 0, s) for t, s in zip(train, [1, 0, 0, 0], strict=True)] + [
        _ep("a", k, 0.0) for k in range(3)
    ]
    baseline = [_ep("a@0000", k, float(k < 2)) for k in range(16)]
    doc = instance_effect(runs, baseline, base, score=STANDARD, reps=200)
    assert doc["splits"] == {"train": 4, "heldout": 1} and doc["epoch_evaluated"] == 10
    assert doc["arms"]["arpo_g8"]["train"] == pytest.approx((0.75 + 0.5) / 2)
    assert doc["arms"]["arpo_g8"]["heldout"] == pytest.approx((0.5 + 0.0) / 2)
    assert doc["arpo"] == doc["arpo"] | {"arm": "arpo_g8", "seeds": 2, "train": pytest.approx(0.625)}
    assert doc["grpo"]["train"] == pytest.approx(0.25) and doc["image_blind"]["train"] == pytest.approx(0.75)
    assert doc["base"]["train"] == pytest.approx(0.25)
    assert doc["base"]["heldout"] == pytest.approx(0.0)  # paired on the 2 held-out instances the arms played
    assert doc["arpo_minus_grpo"]["train"]["mean"] == pytest.approx(0.375)
    assert doc["arpo_minus_base"]["train"]["mean"] == pytest.approx(0.375)
    assert doc["arpo_minus_image_blind"]["train"]["mean"] == pytest.approx(-0.125)
    lo, hi = doc["arpo_minus_grpo"]["train"]["ci95"]
    assert lo <= 0.375 <= hi
    assert doc["arms"]["arpo_g8"]["curve"]["train"] == {"5": 1.0, "10": pytest.approx(0.625)}
    assert doc["arms"]["arpo_g8_blind"]["counts"] == {"a@0000": {"all_fail_groups": 2.0, "replay_fills": 1.0}}
    assert doc["baseline_sampled_success"] == {"a@0000": 0.125}
    assert doc["arpo_preload"]["seeds"] == 0 and doc["arpo_preload"]["train"] is None
