"""Evaluation statistics with hand-computed values, and `evaluate_policy` over a fake pool/generator
driven by the real rollout loop."""

from __future__ import annotations

import json
import math
from concurrent.futures import Future

import pytest
from PIL import Image
from rollout_configs import rollout_cfg

from arpo_core.algorithm.rollout import RolloutConfig
from arpo_core.analysis.evaluation import (
    Z95,
    click_spread,
    episode_score,
    eval_jobs,
    evaluate_policy,
    first_click,
    last_action_kind,
    pooled_rate,
    split_map,
    summarize,
    wilson_interval,
)
from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.pool import EnvResult
from arpo_core.policy.generate import Generation
from arpo_core.trajectory import Step, Trajectory

PNG = b"\x89PNG-not-decoded-here"


def traj(
    task_id, success, n_steps=1, domain="miniwob", parse_ok=True, last_kind="click", point=(1.0, 2.0)
) -> Trajectory:
    steps = []
    for i in range(n_steps):
        last = i == n_steps - 1
        ok = parse_ok or not last
        actions = [{"kind": last_kind if last else "click", "point": list(point)}]
        steps.append(
            Step(
                step_idx=i,
                screenshot_png=PNG,
                screen_w=160,
                screen_h=210,
                actions_json=json.dumps(actions) if ok else json.dumps({"parse_error": "x"}),
                parse_ok=ok,
            )
        )
    return Trajectory("r", "evaluate", 0, domain, task_id, "do it", steps, success=success)


# ------------------------------------------------------------------------------------------------ Wilson


@pytest.mark.parametrize(
    ("k", "n", "lo", "hi"),
    [
        # p = 0.3, z^2 = 3.841459: centre = (0.3 + 0.192073) / 1.384146 = 0.355504,
        # half = 1.959964 * sqrt(0.021 + 0.009604) / 1.384146 = 0.247713.
        (3, 10, 0.107791, 0.603222),
        # 0/10: centre = half = 0.192073 / 1.384146 = 0.138766 -> (0, 0.277533).
        (0, 10, 0.0, 0.277533),
        (10, 10, 0.722467, 1.0),
        # 1/2: centre 0.5; half = 1.959964 * sqrt(0.125 + 0.240091) / 2.920730 = 0.405469.
        (1, 2, 0.094531, 0.905469),
    ],
)
def test_wilson_interval_hand_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=2e-6)


def test_wilson_interval_edge_cases():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="k <= n"):
        wilson_interval(3, 2)
    # Fractional scores (OSWorld partial credit) are accepted: 2.5 of 5 is centred at 0.5.
    lo, hi = wilson_interval(2.5, 5)
    assert (lo + hi) / 2 == pytest.approx(0.5)


def test_pooled_rate_is_task_mean_with_stratified_interval():
    # Tasks 1/2 and 2/2: rate = (0.5 + 1.0) / 2 = 0.75.
    # Agresti-Coull: p~1 = (1 + 1.920730) / 5.841459 = 0.5, Var1 = 0.25 / 5.841459 = 0.0427975;
    # p~2 = 3.920730 / 5.841459 = 0.671190, Var2 = 0.671190 * 0.328810 / 5.841459 = 0.0377806.
    # half = 1.959964 * sqrt(0.0805781) / 2 = 0.278181 -> (0.471819, 1.028181 clipped to 1).
    s = pooled_rate([(1, 2), (2, 2)])
    assert s.rate == pytest.approx(0.75)
    assert s.ci_low == pytest.approx(0.471819, abs=2e-6)
    assert s.ci_high == 1.0
    assert (s.episodes, s.tasks) == (4, 2)


def test_pooled_rate_weighs_tasks_equally_not_episodes():
    # 10/10 on one task, 0/2 on another: the episode mean would be 10/12; the task mean is 0.5.
    assert pooled_rate([(10, 10), (0, 2)]).rate == pytest.approx(0.5)
    assert pooled_rate([(0, 0), (1, 4)]).tasks == 1  # empty cells are skipped
    assert pooled_rate([]).episodes == 0


def test_pooled_interval_has_width_even_when_every_task_is_0_or_1():
    s = pooled_rate([(0, 8), (8, 8)])
    assert s.rate == 0.5 and s.ci_low < 0.5 < s.ci_high


# ------------------------------------------------------------------------------------------------ scores


def test_last_action_kind_and_osworld_hard():
    fail_at_limit = traj("a", 1.0, n_steps=3, last_kind="call_user")
    assert last_action_kind(fail_at_limit) == "call_user"
    assert episode_score(fail_at_limit, "standard", max_steps=3) == 1.0
    assert episode_score(fail_at_limit, "osworld_hard", max_steps=3) == 0.0  # hit the limit + FAIL
    assert episode_score(fail_at_limit, "osworld_hard", max_steps=4) == 1.0  # stopped before the limit
    done_at_limit = traj("a", 1.0, n_steps=3, last_kind="finished")
    assert episode_score(done_at_limit, "osworld_hard", max_steps=3) == 1.0
    assert last_action_kind(traj("a", 0.0, parse_ok=False)) is None
    with pytest.raises(ValueError, match="scoring"):
        episode_score(done_at_limit, "hard", 3)  # type: ignore[arg-type]


def test_click_spread_hand_values():
    # (0, 0) and (6, 8): mean (3, 4); var_x = 9, var_y = 16 -> sqrt(25) = 5
    assert click_spread([(0.0, 0.0), (6.0, 8.0)]) == 5.0
    assert click_spread([(2.0, 2.0)] * 4) == 0.0  # a constant click: image-blind
    assert click_spread([(1.0, 1.0)]) is None
    assert first_click(traj("a", 1.0, point=(7.0, 9.0))) == (7.0, 9.0)
    assert first_click(traj("a", 0.0, parse_ok=False)) is None


def test_summarize_reports_click_spread_per_task_and_pooled():
    trajs = [
        traj("t1", 1.0, point=(0, 0)),
        traj("t1", 0.0, point=(6, 8)),  # t1 spread 5
        traj("t2", 1.0, point=(3, 3)),
        traj("t2", 1.0, point=(3, 3)),  # t2 spread 0
        traj("t3", 0.0, point=(9, 9)),  # one episode: no spread
    ]
    m = summarize(trajs, SPLITS, scoring="standard", max_steps=3)
    assert m["eval/task/miniwob/t1/click_spread_px"] == 5.0
    assert m["eval/in_domain/click_spread_px"] == 2.5  # mean over t1, t2
    assert "eval/out_of_domain/click_spread_px" not in m
    assert m["eval/all/click_spread_px"] == 2.5


# ------------------------------------------------------------------------------------------------ summarize


SPLITS = {
    ("miniwob", "t1"): "in_domain",
    ("miniwob", "t2"): "in_domain",
    ("miniwob", "t3"): "out_of_domain",
    ("chrome", "t1"): "out_of_domain",  # same id, other domain: a different task
}


def test_summarize_hand_values():
    trajs = [
        traj("t1", 1.0, n_steps=1),
        traj("t1", 0.0, n_steps=3),
        traj("t2", 1.0, n_steps=2),
        traj("t2", 1.0, n_steps=2),
        traj("t3", 0.0, n_steps=1, parse_ok=False),
        traj("t3", 0.0, n_steps=1),
        traj("t1", 0.5, n_steps=4, domain="chrome"),
    ]
    m = summarize(trajs, SPLITS, scoring="standard", max_steps=3)
    # in_domain: t1 1/2, t2 2/2 -> 0.75 (interval: test_pooled_rate_is_task_mean_with_stratified_interval)
    assert m["eval/in_domain/success_rate"] == pytest.approx(0.75)
    assert m["eval/in_domain/success_ci_low"] == pytest.approx(0.471819, abs=2e-6)
    assert m["eval/in_domain/episodes"] == 4 and m["eval/in_domain/tasks"] == 2
    assert m["eval/in_domain/mean_steps"] == pytest.approx((1 + 3 + 2 + 2) / 4)
    assert m["eval/in_domain/format_error_rate"] == 0.0
    # out_of_domain: miniwob/t3 0/2, chrome/t1 0.5/1 -> (0 + 0.5) / 2
    assert m["eval/out_of_domain/success_rate"] == pytest.approx(0.25)
    assert m["eval/out_of_domain/format_error_rate"] == pytest.approx(1 / 3)
    # per task: Wilson on 1 of 2
    assert m["eval/task/miniwob/t1/success_rate"] == 0.5
    assert m["eval/task/miniwob/t1/success_ci_low"] == pytest.approx(0.094531, abs=2e-6)
    assert m["eval/task/chrome/t1/episodes"] == 1
    # per domain and all
    assert m["eval/domain/miniwob/success_rate"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert m["eval/domain/chrome/success_rate"] == 0.5
    assert m["eval/all/success_rate"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.5) / 4)
    assert m["eval/all/episodes"] == 7
    assert all(isinstance(v, float) for v in m.values())
    json.dumps(m)  # JSON-able


def test_summarize_options_and_errors():
    trajs = [traj("t1", 1.0, n_steps=2, last_kind="call_user"), traj("t2", 1.0)]
    hard = summarize(trajs, SPLITS, scoring="osworld_hard", max_steps=2, prefix="eval/greedy", per_task=False)
    assert hard["eval/greedy/in_domain/success_rate"] == pytest.approx(0.5)  # t1 scores 0 under Hard
    assert not any("/task/" in k for k in hard)
    with pytest.raises(KeyError, match="miniwob/zz"):
        summarize([traj("zz", 1.0)], SPLITS, scoring="standard", max_steps=3)
    with pytest.raises(ValueError, match="collide"):
        summarize([], {("miniwob", "t1"): "all"}, scoring="standard", max_steps=3)


def test_summarize_cleans_metric_keys():
    m = summarize([traj("a:b?c", 1.0)], {("miniwob", "a:b?c"): "in_domain"}, scoring="standard", max_steps=3)
    assert "eval/task/miniwob/a_b_c/success_rate" in m


def test_split_map_from_taskspecs():
    tasks = [TaskSpec("miniwob", "a"), TaskSpec("miniwob", "b", split="out_of_domain")]
    assert split_map(tasks) == {("miniwob", "a"): "in_domain", ("miniwob", "b"): "out_of_domain"}


# ------------------------------------------------------------------------------------------------ evaluate_policy


def done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class FakePool:
    """Env whose episode succeeds iff its seed is even; one click ends it."""

    def __init__(self, n: int):
        self.n = n
        self.seeds: list[tuple[str, int]] = []
        self._seed: dict[int, int] = {}

    def _obs(self, task: TaskSpec) -> Observation:
        return Observation(Image.new("RGB", (160, 210), "white"), task.task_id, (160, 210))

    def submit_reset(self, env_idx, task, seed=None):
        self.seeds.append((task.task_id, seed))
        self._seed[env_idx] = seed
        self._task = task
        return done(EnvResult(env_idx, observation=self._obs(task)))

    def submit_step(self, env_idx, actions):
        obs = Observation(Image.new("RGB", (160, 210), "white"), "", (160, 210))
        return done(EnvResult(env_idx, observation=obs, done=True))

    def submit_evaluate(self, env_idx):
        return done(EnvResult(env_idx, score=1.0 if self._seed[env_idx] % 2 == 0 else 0.0))


class FakeGenerator:
    """Clicks, except on the task whose instruction is 'bad' (a format error)."""

    def __init__(self):
        self.temperatures: list[float] = []

    def generate(self, batch, *, temperature, top_p, max_new_tokens, seeds=None):
        self.temperatures.append(temperature)
        out = []
        for p in batch:
            text = (
                "no action here" if p.instruction == "bad" else "Thought: t\nAction: click(start_box='(5,5)')"
            )
            out.append(Generation(text, (1, 2), (-0.1, -0.2), "stop"))
        return out


def greedy_rollout() -> RolloutConfig:
    """Greedy rollouts of at most 5 steps with a -1 format penalty (the evaluations below)."""
    return rollout_cfg(temperature=0.0, seed=10)


def test_eval_jobs_use_a_different_env_seed_per_episode():
    tasks = [TaskSpec("miniwob", "a"), TaskSpec("miniwob", "b")]
    jobs = eval_jobs(tasks, 3, seed=100)
    assert [(j.task.task_id, j.seed, j.group_id, j.sample_idx) for j in jobs] == [
        ("a", 100, 0, 0),
        ("a", 101, 0, 1),
        ("a", 102, 0, 2),
        ("b", 100, 1, 0),
        ("b", 101, 1, 1),
        ("b", 102, 1, 2),
    ]
    with pytest.raises(ValueError):
        eval_jobs(tasks, 0, 0)


def test_evaluate_policy_with_fake_pool_and_generator():
    tasks = [
        TaskSpec("miniwob", "good"),
        TaskSpec("miniwob", "bad", split="out_of_domain"),
    ]
    pool, gen = FakePool(3), FakeGenerator()
    rollout = greedy_rollout()
    res = evaluate_policy(pool, gen, tasks, 4, rollout, first_seed=10, scoring="standard")
    assert sorted(pool.seeds) == sorted([(t, 10 + k) for t in ("good", "bad") for k in range(4)])
    assert set(gen.temperatures) == {0.0}  # greedy
    m = res.metrics
    # seeds 10..13: two even -> 0.5 on "good"; "bad" never parses -> 0 and format errors
    assert m["eval/in_domain/success_rate"] == 0.5
    assert m["eval/in_domain/episodes"] == 4
    assert m["eval/out_of_domain/success_rate"] == 0.0
    assert m["eval/out_of_domain/format_error_rate"] == 1.0
    assert m["eval/all/failed_jobs"] == 0.0
    assert m["eval/in_domain/success_ci_low"] < 0.5 < m["eval/in_domain/success_ci_high"]
    assert "eval/time/rollout_s" in m
    assert len(res.trajectories) == 8 and res.failed == []
    assert math.isclose(Z95, 1.959964, abs_tol=1e-6)


class CountingPool(FakePool):
    """FakePool whose fault counters (pool.py, decision "Fault counting") grow by one timeout per reset of
    'good'."""

    def __init__(self, n: int):
        super().__init__(n)
        self.timeouts = 0

    def submit_reset(self, env_idx, task, seed=None):
        self.timeouts += task.task_id == "good"
        return super().submit_reset(env_idx, task, seed)

    def fault_counts(self):
        return {"timeouts": self.timeouts, "browser_crashes": 0}

    def task_fault_counts(self):
        return {("miniwob", "good"): {"timeouts": self.timeouts}} if self.timeouts else {}


def test_evaluation_reports_the_env_faults_of_its_call_under_its_prefix():
    pool = CountingPool(3)
    pool.timeouts = 5  # faults before the call are not this evaluation's
    tasks = [TaskSpec("miniwob", "good"), TaskSpec("miniwob", "other")]
    rollout = greedy_rollout()
    m = evaluate_policy(
        pool, FakeGenerator(), tasks, 3, rollout, first_seed=10, scoring="standard", prefix="eval/base/greedy"
    ).metrics
    assert m["eval/base/greedy/rollout/faults/timeouts"] == 3.0
    assert m["eval/base/greedy/rollout/faults/browser_crashes"] == 0.0
    assert m["eval/base/greedy/task/miniwob/good/env_faults"] == 3.0
    assert "eval/base/greedy/task/miniwob/other/env_faults" not in m
