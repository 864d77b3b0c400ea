"""benchmarks/rollout_sim.py: the project's rollout loop (sync and async) under a simulated clock, with
fake OSWorld-like envs and a generation cost model. Times here are simulated seconds, fully
deterministic: no wall-clock assertion."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import rollout_sim as rs  # noqa: E402
from rollout_configs import rollout_cfg  # noqa: E402

from arpo_core.algorithm.rollout import make_group_jobs, run_episodes  # noqa: E402
from arpo_core.envs.base import TaskSpec  # noqa: E402


class FixedPool(rs.SimPool):
    """Resets and evaluations 0.1 s; steps `step_s[env]` seconds."""

    def __init__(self, n, clock, step_s):
        super().__init__(n, clock)
        self.step_s = step_s

    def latency(self, i, kind):
        return self.step_s[i] if kind == "step" else 0.1


class FixedCostGenerator(rs.SimGenerator):
    def __init__(self, clock, p_finish, seconds):
        super().__init__(clock, p_finish)
        self.seconds, self.batches = seconds, []

    def cost(self, batch):
        self.batches.append(len(batch))
        return self.seconds


def cfg(mode, batch_wait_s=0.0, max_steps=5):
    return rollout_cfg(
        max_steps=max_steps,
        max_new_tokens=8,
        min_pixels=256,
        max_pixels=2_116_800,
        mode=mode,
        batch_wait_s=batch_wait_s,
    )


def run(mode, step_s, n_jobs, gen_s=0.1, batch_wait_s=0.0):
    clock = rs.SimClock()
    pool = FixedPool(len(step_s), clock, step_s)
    gen = FixedCostGenerator(clock, p_finish=0.0, seconds=gen_s)
    jobs = make_group_jobs([TaskSpec("osworld", "t", instruction="do t")], n_jobs, seed=0)
    res = run_episodes(pool, gen, jobs, cfg(mode, batch_wait_s), clock=clock)
    return res, gen


def texts(res):
    return [[s.response_text for s in t.steps] for t in res.trajectories]


def test_async_envs_do_not_wait_for_the_slowest_env():
    """One env steps in 10 s, three in 1 s; 8 five-step episodes. Sync: every round waits for the slow
    env (two jobs per env, ~2 x 5 x 10 s). Async: the fast envs play 7 episodes while the slow one plays
    its first, so the call ends with the slow env's one episode (~5 x 10 s)."""
    sync, _ = run("sync", [10.0, 1.0, 1.0, 1.0], n_jobs=8)
    async_, _ = run("async", [10.0, 1.0, 1.0, 1.0], n_jobs=8)
    assert texts(async_) == texts(sync)
    assert sync.metrics["time/rollout_s"] >= 2 * 5 * 10.0  # the slow env's steps set every round
    assert async_.metrics["time/rollout_s"] == pytest.approx(0.1 + 5 * (0.1 + 10.0) + 0.1, abs=0.2)
    assert async_.metrics["rollout/env_utilization"] > 1.3 * sync.metrics["rollout/env_utilization"]


def test_batch_wait_lets_a_slightly_later_env_join_the_batch():
    """Envs step in 1.0 and 1.2 s. Without a wait, async generates for each as it comes back (batches of
    1 after the first); with a 0.3 s wait, both prompts share every batch."""
    _, no_wait = run("async", [1.0, 1.2], n_jobs=2, gen_s=0.05)
    _, wait = run("async", [1.0, 1.2], n_jobs=2, gen_s=0.05, batch_wait_s=0.3)
    assert no_wait.batches == [2] + [1] * 8
    assert wait.batches == [2] * 5
    _, short = run("async", [1.0, 1.2], n_jobs=2, gen_s=0.05, batch_wait_s=0.1)
    assert short.batches == no_wait.batches  # the wait is bounded: 0.1 s is not enough for a 0.2 s gap


def test_sync_mode_batches_every_live_episode():
    _, gen = run("sync", [1.0, 1.2, 3.0], n_jobs=3)
    assert gen.batches == [3] * 5


def test_gen_latency_grows_with_batch_and_history():
    assert rs.gen_latency([]) == 0.0
    one, eight, full = rs.gen_latency([1]), rs.gen_latency([1] * 8), rs.gen_latency([1] * 128)
    assert one == pytest.approx(eight)  # 8 replicas: one row each
    assert full > eight
    assert rs.gen_latency([15] * 16) > rs.gen_latency([1] * 16)


def test_simulated_epoch_same_episodes_in_both_modes():
    sync = rs.simulate("sync", n_envs=16, iterations=1)
    async_ = rs.simulate("async", n_envs=16, iterations=1, batch_wait_s=0.5)
    assert sync.pop("_signature") == async_.pop("_signature")
    assert sync["env_steps"] == async_["env_steps"] > 128
    assert 0 < sync["env_utilization"] <= 1 and 0 < async_["env_utilization"] <= 1
