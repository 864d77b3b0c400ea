"""Rollout loop: batching, queueing over few envs, format errors, env-fault retries, metrics, seeds that
follow the job and not the env or the timing; and end-to-end runs with the tiny policy on real MiniWoB
(the same job list gives the same trajectories with 1 or 4 envs, process or Ray workers)."""

from __future__ import annotations

import functools
import json
import random
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image
from rollout_configs import rollout_cfg

from arpo_core.algorithm.rollout import EpisodeJob, RolloutConfig, make_group_jobs, run_episodes
from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.pool import EnvResult
from arpo_core.infra.seeds import derive_seed
from arpo_core.policy.generate import Generation
from arpo_core.policy.prompt import PromptSpec

SCREEN = (160, 210)
MODES = ["sync", "async"]
ROOT = Path(__file__).resolve().parents[1]
GROUNDED = ROOT / "assets" / "checkpoints" / "grounded-xs"


def done_future(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class FakePool:
    """Envs where an episode succeeds when the agent clicks left of x=80 (screen px) and ends after
    `steps_to_done` steps. `faults` maps (task_id, seed) -> number of resets that fail first."""

    def __init__(self, n, steps_to_done=2, faults=None, step_faults=None):
        self.n = n
        self.steps_to_done = steps_to_done
        self.faults = dict(faults or {})
        self.step_faults = dict(step_faults or {})
        self.state = {}
        self.log = []

    def obs(self, i):
        return Observation(Image.new("RGB", SCREEN, (i * 20, 0, 0)), f"instr {self.state[i]['task']}", SCREEN)

    def submit_reset(self, i, task, seed):
        self.log.append(("reset", i, task.task_id, seed))
        key = (task.task_id, seed)
        if self.faults.get(key, 0) > 0:
            self.faults[key] -= 1
            return done_future(EnvResult(i, done=True, error="browser crashed"))
        self.state[i] = {"task": task.task_id, "seed": seed, "steps": 0, "good": False}
        return done_future(EnvResult(i, observation=self.obs(i)))

    def submit_step(self, i, actions):
        st = self.state[i]
        self.log.append(("step", i, [(a.kind, a.point) for a in actions]))
        key = (st["task"], st["seed"])
        if self.step_faults.get(key, 0) > 0:
            self.step_faults[key] -= 1
            return done_future(EnvResult(i, done=True, error="step timed out"))
        st["steps"] += 1
        st["good"] = st["good"] or any(a.point and a.point[0] < 80 for a in actions)
        return done_future(EnvResult(i, observation=self.obs(i), done=st["steps"] >= self.steps_to_done))

    def submit_evaluate(self, i):
        self.log.append(("evaluate", i))
        return done_future(EnvResult(i, done=True, score=1.0 if self.state[i]["good"] else 0.0))


class ScriptedGenerator:
    """Reply chosen by the instruction's task id; records batch sizes and seeds."""

    def __init__(self, replies):
        self.replies = replies
        self.batches = []
        self.seeds = []

    def generate(self, batch, *, temperature, top_p, max_new_tokens, seeds=None):
        self.batches.append(len(batch))
        self.seeds.append(list(seeds))
        out = []
        for p in batch:
            text = self.replies[p.instruction.split()[-1]]
            out.append(Generation(text, (5, 6, 7), (-0.5, -0.25, -0.25), "stop"))
        return out


GOOD = "Thought: left.\nAction: click(start_box='(20,30)')"
BAD_CLICK = "Thought: right.\nAction: click(start_box='(150,30)')"
GARBAGE = "I think I should click somewhere"


def tasks(*ids):
    return [TaskSpec(domain="fake", task_id=t, split="in_domain") for t in ids]


@pytest.mark.parametrize("extra", [{}, {"groups_per_task": 1}])
def test_group_jobs_layout(extra):
    """One group per task (the default, and groups_per_task=1): group g is task g, on instance seed + g.
    Pinned: the jobs, so the env seeds and sampling seeds (rollout.py, decision "Per-step sampling seeds") of
    groups_per_task=1 never move."""
    jobs = make_group_jobs(tasks("a", "b"), group_size=3, seed=10, first_group=4, **extra)
    assert [(j.task.task_id, j.group_id, j.sample_idx, j.seed) for j in jobs] == [
        ("a", 4, 0, 10),
        ("a", 4, 1, 10),
        ("a", 4, 2, 10),
        ("b", 5, 0, 11),
        ("b", 5, 1, 11),
        ("b", 5, 2, 11),
    ]


def test_groups_per_task_gives_each_group_its_own_instance_and_group_id():
    jobs = make_group_jobs(tasks("a", "b"), group_size=2, seed=10, first_group=4, groups_per_task=3)
    assert [(j.task.task_id, j.group_id, j.sample_idx, j.seed) for j in jobs] == [
        ("a", 4, 0, 10),
        ("a", 4, 1, 10),
        ("a", 5, 0, 11),
        ("a", 5, 1, 11),
        ("a", 6, 0, 12),
        ("a", 6, 1, 12),
        ("b", 7, 0, 13),
        ("b", 7, 1, 13),
        ("b", 8, 0, 14),
        ("b", 8, 1, 14),
        ("b", 9, 0, 15),
        ("b", 9, 1, 15),
    ]
    instances = {(j.task.task_id, j.seed) for j in jobs}
    groups = {(j.group_id, j.task.task_id, j.seed) for j in jobs}
    # group ids are unique, a group is one task on one instance, a task's groups play distinct instances
    assert len(groups) == len({g for g, *_ in groups}) == len(instances) == 6


def test_groups_per_task_rollout_plays_each_group_on_its_instance():
    pool = FakePool(n=3, steps_to_done=1)
    jobs = make_group_jobs(tasks("a"), group_size=2, seed=5, groups_per_task=2)
    res = run_episodes(pool, ScriptedGenerator({"a": GOOD}), jobs, rollout_cfg())
    assert [(t.group_id, t.sample_idx) for t in res.trajectories] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    resets = sorted(entry[3] for entry in pool.log if entry[0] == "reset")  # ("reset", env, task, seed)
    assert resets == [5, 5, 6, 6]


def test_more_jobs_than_envs_all_finish_in_job_order_with_batched_generation():
    pool = FakePool(n=3, steps_to_done=2)
    gen = ScriptedGenerator({"a": GOOD, "b": BAD_CLICK})
    jobs = make_group_jobs(tasks("a", "b"), group_size=4, seed=0)
    res = run_episodes(pool, gen, jobs, rollout_cfg(max_steps=5), run_id="r", stage="train", epoch=2)
    assert res.failed == []
    assert [(t.task_id, t.sample_idx) for t in res.trajectories] == [
        (j.task.task_id, j.sample_idx) for j in jobs
    ]
    assert [t.success for t in res.trajectories] == [1.0] * 4 + [0.0] * 4
    assert all(len(t.steps) == 2 and t.steps[-1].done and not t.steps[0].done for t in res.trajectories)
    assert max(gen.batches) == 3  # every live env in one generation call
    assert sum(gen.batches) == 16  # 8 episodes x 2 steps
    t = res.trajectories[0]
    assert t.epoch == 2 and t.stage == "train" and t.run_id == "r" and t.reward == 1.0
    # model coords (20, 30) in a 168x224 model image -> screen (19.05.., 28.1..)
    acts = json.loads(t.steps[0].actions_json)
    assert acts[0]["kind"] == "click"
    assert acts[0]["point"] == pytest.approx([20 * 160 / 168, 30 * 210 / 224])
    assert t.steps[0].response_token_ids == [5, 6, 7]
    assert t.steps[0].gen_logprob_sum == pytest.approx(-1.0)
    assert res.metrics["rollout/success_rate"] == 0.5
    assert res.metrics["rollout/episodes"] == 8


@pytest.mark.parametrize("mode", MODES)
def test_format_error_ends_episode_without_env_step_and_gets_penalty(mode):
    pool = FakePool(n=2)
    gen = ScriptedGenerator({"a": GARBAGE})
    res = run_episodes(
        pool, gen, make_group_jobs(tasks("a"), 2, 0), rollout_cfg(format_penalty=-0.5, mode=mode)
    )
    assert [t.reward for t in res.trajectories] == [-0.5, -0.5]
    t = res.trajectories[0]
    assert len(t.steps) == 1 and not t.steps[0].parse_ok and t.steps[0].done
    assert "parse_error" in json.loads(t.steps[0].actions_json)
    assert not [e for e in pool.log if e[0] in ("step", "evaluate")]
    assert res.metrics["rollout/format_error_rate"] == 1.0


def test_replies_are_parsed_in_the_policys_grammar_and_frame():
    """rollout.py, decisions "Format errors" and "Screen coordinates": a Qwen3-VL tool call in 0-1000 units is parsed with
    action_format qwen3vl_tool_call and mapped by coord_mode relative1000; the same text is a format
    error under the UI-TARS grammar; in pixels, the model image is resized with the policy's factor (the
    160x210 screen is 168x224 at 28, 160x224 at 32)."""
    tool = '<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [250, 500]}}\n</tool_call>'
    cfg = rollout_cfg(max_steps=1, action_format="qwen3vl_tool_call", coord_mode="relative1000")
    pool = FakePool(n=1, steps_to_done=1)
    (t,) = run_episodes(
        pool, ScriptedGenerator({"a": tool}), make_group_jobs(tasks("a"), 1, 0), cfg
    ).trajectories
    assert t.steps[0].parse_ok and t.success == 1.0
    assert [e for e in pool.log if e[0] == "step"] == [("step", 0, [("click", (40.0, 105.0))])]
    (t,) = run_episodes(
        FakePool(n=1),
        ScriptedGenerator({"a": tool}),
        make_group_jobs(tasks("a"), 1, 0),
        rollout_cfg(max_steps=1),
    ).trajectories
    assert not t.steps[0].parse_ok
    points = []
    for factor in (28, 32):
        pool = FakePool(n=1, steps_to_done=1)
        cfg = rollout_cfg(max_steps=1, patch_factor=factor)
        run_episodes(
            pool,
            ScriptedGenerator({"a": "Action: click(start_box='(80,112)')"}),
            make_group_jobs(tasks("a"), 1, 0),
            cfg,
        )
        points += [e[2][0][1] for e in pool.log if e[0] == "step"]
    assert points == [(80 * 160 / 168, 105.0), (80.0, 105.0)]
    with pytest.raises(ValueError, match="action_format"):
        rollout_cfg(action_format="json")


def test_max_steps_stops_and_evaluates():
    pool = FakePool(n=1, steps_to_done=100)
    res = run_episodes(
        pool, ScriptedGenerator({"a": GOOD}), make_group_jobs(tasks("a"), 1, 0), rollout_cfg(max_steps=3)
    )
    (t,) = res.trajectories
    assert len(t.steps) == 3 and not t.steps[-1].done
    assert t.success == 1.0  # the checker decides, even when the step limit ended the episode


@pytest.mark.parametrize("mode", MODES)
def test_env_faults_are_retried_then_reported_not_scored(mode):
    # a: first reset fails once (retried, succeeds); b: always fails (reported); c: one step fault.
    pool = FakePool(n=2, faults={("a", 0): 1, ("b", 1): 99}, step_faults={("c", 2): 1})
    gen = ScriptedGenerator({"a": GOOD, "b": GOOD, "c": GOOD})
    jobs = [
        EpisodeJob(tasks("a")[0], 0),
        EpisodeJob(tasks("b")[0], 1, group_id=1),
        EpisodeJob(tasks("c")[0], 2, group_id=2),
    ]
    res = run_episodes(pool, gen, jobs, rollout_cfg(env_retries=2, mode=mode))
    assert [t.task_id for t in res.trajectories] == ["a", "c"]
    assert all(t.success == 1.0 and t.env_error == "" for t in res.trajectories)
    assert (
        len(res.failed) == 1
        and res.failed[0][0].task.task_id == "b"
        and "browser crashed" in res.failed[0][1]
    )
    assert res.metrics["rollout/env_faults"] == 1 + 3 + 1
    assert res.metrics["rollout/failed_jobs"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_time_split_adds_up(mode):
    pool = FakePool(n=2)
    cfg = rollout_cfg(mode=mode)
    res = run_episodes(pool, ScriptedGenerator({"a": GOOD}), make_group_jobs(tasks("a"), 4, 0), cfg)
    m = res.metrics
    assert m["time/env_wait_s"] + m["time/inference_s"] + m["time/other_s"] == pytest.approx(
        m["time/rollout_s"], rel=1e-6
    )


class SeededReplies:
    """A stand-in policy whose reply is drawn from the prompt's seed alone (as HFGenerator's is): a good
    click, a bad click or garbage; records which seeds it saw for which (instruction, step)."""

    def __init__(self):
        self.seen = {}

    def generate(self, batch, *, temperature, top_p, max_new_tokens, seeds=None):
        out = []
        for p, seed in zip(batch, seeds, strict=True):
            self.seen.setdefault((p.instruction, len(p.replies)), set()).add(seed)
            text = random.Random(seed).choice([GOOD, BAD_CLICK, BAD_CLICK, GARBAGE])
            out.append(Generation(text, (seed % 97,), (-float(seed % 13),), "stop"))
        return out


def signature(res):
    return [
        (t.task_id, t.group_id, t.sample_idx, t.reward, [(s.response_text, s.actions_json) for s in t.steps])
        for t in res.trajectories
    ]


def test_sampling_seed_is_derived_from_job_and_step():
    """rollout.py, decision "Per-step sampling seeds": step s of job j is sampled with derive_seed('sample',
    seed, epoch, iteration, j, s)."""
    gen = ScriptedGenerator({"a": GOOD, "b": GOOD})
    jobs = make_group_jobs(tasks("a", "b"), group_size=2, seed=0)
    run_episodes(FakePool(n=4, steps_to_done=2), gen, jobs, rollout_cfg(seed=5), epoch=3, iteration=1)
    want = {derive_seed("sample", 5, 3, 1, j, s) for j in range(4) for s in range(2)}
    assert {x for batch in gen.seeds for x in batch} == want


@pytest.mark.parametrize("n_envs", [1, 2, 3, 8])
def test_trajectories_do_not_depend_on_the_number_of_envs(n_envs):
    """Who shares a batch, and which env plays which job, changes with the pool size; the episodes do not."""
    jobs = make_group_jobs(tasks("a", "b", "c"), group_size=3, seed=0)
    cfg = rollout_cfg(max_steps=3, seed=11)
    ref = run_episodes(FakePool(n=4, steps_to_done=3), SeededReplies(), jobs, cfg, epoch=1)
    res = run_episodes(FakePool(n=n_envs, steps_to_done=3), SeededReplies(), jobs, cfg, epoch=1)
    assert signature(res) == signature(ref)
    assert [t.steps[0].gen_logprob_sum for t in res.trajectories] == [
        t.steps[0].gen_logprob_sum for t in ref.trajectories
    ]
    other = run_episodes(FakePool(n=n_envs, steps_to_done=3), SeededReplies(), jobs, cfg, epoch=2)
    assert signature(other) != signature(ref)  # another epoch draws other seeds


@pytest.mark.parametrize("mode", MODES)
def test_retried_episode_equals_a_clean_one(mode):
    """A job re-run after an env fault (rollout.py, decision "Env fault retries") draws the same seeds: the
    same episode comes out."""
    jobs = make_group_jobs(tasks("a", "b"), group_size=2, seed=0)
    cfg = rollout_cfg(max_steps=3, seed=2, mode=mode)
    clean = run_episodes(FakePool(n=2, steps_to_done=3), SeededReplies(), jobs, cfg)
    faulty = FakePool(n=2, steps_to_done=3, faults={("a", 0): 1}, step_faults={("b", 1): 1})
    res = run_episodes(faulty, SeededReplies(), jobs, cfg)
    assert res.metrics["rollout/env_faults"] >= 1 and res.failed == []
    assert signature(res) == signature(clean)


class DelayedPool:
    """FakePool whose calls come back from other threads after a random delay (0-15 ms, drawn per env
    and call): envs finish in a different order every run, as real ones do."""

    def __init__(self, inner, seed=0):
        from concurrent.futures import ThreadPoolExecutor

        self.inner, self.n = inner, inner.n
        self.rng = random.Random(seed)
        self.threads = ThreadPoolExecutor(max_workers=inner.n + 1)

    def _later(self, fut):
        delay = self.rng.uniform(0, 0.015)
        return self.threads.submit(lambda: (time.sleep(delay), fut.result())[1])

    def submit_reset(self, *a):
        return self._later(self.inner.submit_reset(*a))

    def submit_step(self, *a):
        return self._later(self.inner.submit_step(*a))

    def submit_evaluate(self, *a):
        return self._later(self.inner.submit_evaluate(*a))


@pytest.mark.parametrize(("n_envs", "batch_wait_s"), [(2, 0.0), (4, 0.0), (4, 0.005), (9, 0.01)])
def test_async_and_sync_modes_give_identical_trajectories(n_envs, batch_wait_s):
    """rollout.py, decisions "Sync and async schedules" and "Per-step sampling seeds": the schedule (who
    shares a batch, when an env steps) changes, the episodes, their order, retries and metrics of results do
    not. Envs answer after random delays from other threads."""
    jobs = make_group_jobs(tasks("a", "b", "c"), group_size=3, seed=0)
    faults = {"faults": {("b", 1): 1}, "step_faults": {("c", 2): 1}}
    runs = {}
    for mode in MODES:
        cfg = rollout_cfg(max_steps=4, seed=3, mode=mode, batch_wait_s=batch_wait_s)
        pool = DelayedPool(FakePool(n=n_envs, steps_to_done=4, **faults), seed=n_envs)
        runs[mode] = run_episodes(pool, SeededReplies(), jobs, cfg, epoch=1, iteration=2)
        pool.threads.shutdown()
    sync, async_ = runs["sync"], runs["async"]
    assert signature(async_) == signature(sync)
    assert [t.steps[-1].gen_logprob_sum for t in async_.trajectories] == [
        t.steps[-1].gen_logprob_sum for t in sync.trajectories
    ]
    assert async_.failed == sync.failed == []
    for key in ("rollout/episodes", "rollout/success_rate", "rollout/mean_steps", "rollout/env_faults"):
        assert async_.metrics[key] == sync.metrics[key], key
    assert sync.metrics["rollout/env_faults"] == 2
    # the runs exercise what could differ: several steps, parsed clicks and format errors
    assert {len(t.steps) for t in sync.trajectories} != {1}
    assert {t.format_error for t in sync.trajectories} == {True, False}


def test_rollout_config_checks_the_schedule():
    with pytest.raises(ValueError, match="mode"):
        rollout_cfg(mode="lockstep")
    with pytest.raises(ValueError, match="batch_wait_s"):
        rollout_cfg(batch_wait_s=-1.0)


def test_rollout_config_has_no_defaults_for_params_values():
    with pytest.raises(TypeError, match="temperature"):
        RolloutConfig(max_steps=1)  # params own every value but env_retries
    assert rollout_cfg().env_retries == 2


# ---- real MiniWoB -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grounded():
    """The project's grounded tiny policy: its replies parse, so episodes click and take several steps."""
    import torch

    from arpo_core.policy.model import load_policy

    torch.set_num_threads(1)
    return load_policy(GROUNDED)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def real_tasks() -> list[TaskSpec]:
    """The quick suite (click-test, click-button: one click ends them) and click-checkboxes, where a
    click does not end the episode, so episodes take several steps."""
    from arpo_core.envs.base import load_suite

    quick = load_suite(ROOT / "data" / "suites" / "miniwob_quick.yaml")
    return [*quick, replace(quick[0], task_id="click-checkboxes")]


def play(policy, backend: str, n_envs: int, jobs, cfg):
    from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
    from arpo_core.envs.pool import EnvPool
    from arpo_core.policy.generate import HFGenerator

    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    with EnvPool(functools.partial(make_miniwob_env), n=n_envs, backend=backend) as pool:
        return run_episodes(pool, gen, jobs, cfg, stage="train", epoch=1)


def real_signature(res):
    """What must be identical between two runs of the same jobs: texts, actions, rewards."""
    return [
        (
            (t.task_id, t.group_id, t.sample_idx, t.success, t.reward),
            [(s.response_text, s.actions_json, s.response_token_ids) for s in t.steps],
        )
        for t in res.trajectories
    ]


@pytest.fixture(scope="module")
def one_env_run(grounded):
    jobs = make_group_jobs(real_tasks(), group_size=2, seed=7)
    cfg = rollout_cfg(
        max_steps=3,
        temperature=1.0,
        max_new_tokens=48,
        min_pixels=grounded.min_pixels,
        max_pixels=grounded.max_pixels,
        seed=1,
    )
    return jobs, cfg, play(grounded, "process", 1, jobs, cfg)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "n_envs"), [("process", 4), ("ray", 1), ("ray", 4)])
def test_same_jobs_same_trajectories_with_any_pool(grounded, one_env_run, backend, n_envs, request):
    """rollout.py, decision "Per-step sampling seeds" on real MiniWoB and the real sampler: 1 env (every
    episode alone, in job order) and 4 envs (episodes batched together as envs free up), process or Ray
    workers: the same trajectories."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    jobs, cfg, ref = one_env_run
    res = play(grounded, backend, n_envs, jobs, cfg)
    assert ref.failed == [] and res.failed == []
    assert len(ref.trajectories) == len(jobs)
    assert real_signature(res) == real_signature(ref)
    for a, b in zip(res.trajectories, ref.trajectories, strict=True):
        # batching changes the float sums in the last bits, never the sampled tokens
        assert [s.gen_logprob_sum for s in a.steps] == pytest.approx(
            [s.gen_logprob_sum for s in b.steps], abs=1e-3
        )
    # the run exercises what could differ: parsed clicks and episodes of several steps
    steps = [s for t in ref.trajectories for s in t.steps]
    assert any(s.parse_ok for s in steps) and any(len(t.steps) > 1 for t in ref.trajectories)


@pytest.mark.slow
def test_tiny_policy_on_real_miniwob(tmp_path):
    """The whole path: real Chromium envs in worker processes, an untrained tiny policy's batched generation."""
    import torch

    from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
    from arpo_core.envs.pool import EnvPool
    from arpo_core.policy.generate import HFGenerator
    from arpo_core.policy.model import build_tiny_policy

    torch.set_num_threads(1)
    policy = build_tiny_policy(tmp_path / "p", size="xs")
    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    task = TaskSpec(domain="miniwob", task_id="click-test", split="in_domain", backend="miniwob")
    pool = EnvPool(functools.partial(make_miniwob_env), n=2)
    try:
        res = run_episodes(
            pool, gen, make_group_jobs([task], 3, seed=0), rollout_cfg(max_steps=2, max_new_tokens=24)
        )
    finally:
        pool.close()
    assert len(res.trajectories) == 3 and res.failed == []
    for t in res.trajectories:
        assert t.instruction.startswith("Click")  # the per-episode utterance from MiniWoB
        assert 1 <= len(t.steps) <= 2
        assert t.steps[0].image().size == SCREEN
        assert t.steps[0].response_token_ids
        assert t.reward in (0.0, 1.0, -1.0)


class CountingPool(FakePool):
    """FakePool with the EnvPool's fault counters (pool.py, decision "Fault counting"): each injected fault
    counts one `browser_crashes` (reset) or `timeouts` (step) for its task."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.counts = {"browser_crashes": 0, "timeouts": 0}
        self.per_task = {}

    def _count(self, kind, task_id):
        self.counts[kind] += 1
        per = self.per_task.setdefault(("miniwob", task_id), {"browser_crashes": 0, "timeouts": 0})
        per[kind] += 1

    def submit_reset(self, i, task, seed):
        if self.faults.get((task.task_id, seed), 0) > 0:
            self._count("browser_crashes", task.task_id)
        return super().submit_reset(i, task, seed)

    def submit_step(self, i, actions):
        st = self.state[i]
        if self.step_faults.get((st["task"], st["seed"]), 0) > 0:
            self._count("timeouts", st["task"])
        return super().submit_step(i, actions)

    def fault_counts(self):
        return dict(self.counts)

    def task_fault_counts(self):
        return {k: dict(v) for k, v in self.per_task.items()}


@pytest.mark.parametrize("mode", MODES)
def test_pool_faults_become_rollout_and_per_task_metrics_of_the_call(mode):
    pool = CountingPool(n=2, faults={("a", 0): 2}, step_faults={("c", 2): 1})
    pool.counts["timeouts"] = 5  # faults before this call are not counted again
    gen = ScriptedGenerator({"a": GOOD, "b": GOOD, "c": GOOD})
    jobs = [EpisodeJob(tasks(t)[0], s, group_id=s) for s, t in enumerate("abc")]
    res = run_episodes(pool, gen, jobs, rollout_cfg(env_retries=2, mode=mode))
    m = res.metrics
    assert (m["rollout/faults/browser_crashes"], m["rollout/faults/timeouts"]) == (2.0, 1.0)
    assert m["task/miniwob/a/env_faults"] == 2.0 and m["task/miniwob/c/env_faults"] == 1.0
    assert "task/miniwob/b/env_faults" not in m
    assert m["rollout/env_faults"] == 3.0 and len(res.trajectories) == 3
