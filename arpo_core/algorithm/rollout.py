"""Groups of episodes over an env pool with batched inference (docs/method.md §1, "Rollout system").

Decisions:
- **Sync and async schedules.** Two schedules of the same loop (`RolloutConfig.mode`, params'
  `env.rollout.mode`), one policy version per call. `sync` (step-synchronous, the reference's): once every
  pending reset and step has come back, every live episode's prompt goes to the generator as ONE batch, the
  parsed actions go to the envs in parallel, and the loop waits for all of them before the next batch.
  `async`: an env steps as soon as ITS reply is ready, and the generator takes whatever prompts are ready when
  it is free: at once when no other env call is pending, else once the oldest waiting prompt has waited
  `batch_wait_s` (a bounded wait to fill the batch); so no env idles while another is slow and no
  generation waits for the slowest env. In both, a finished episode is evaluated at once through the
  pool's futures while the others keep stepping, and its env immediately takes the next queued job (the
  per-env executor runs the reset after the evaluation), so with more jobs than envs no env idles until
  the queue is empty. Results do not depend on the mode (decision "Per-step sampling seeds"): the same
  trajectories, retries and output order. The loop is a small state object (`_Rollout`) whose methods are its
  phases: `start` (an env takes a job), `collect` (route the env calls that came back), `batch_due`,
  `generate`, `step` (send each reply's actions), `wait`, `fault`, `finish`.
- **Format errors.** A reply that does not parse is a format error: the step is recorded (parse_ok False), the
  episode ends without touching the env, success is 0 and the reward gets the format penalty (docs/method.md
  §1). Model text is never executed: it goes through `parse_reply` in the policy's grammar
  (`RolloutConfig.action_format`, params' `policy.action_format`) only.
- **Env fault retries.** Env faults (timeout, crashed browser, failed reset) are not policy failures: the
  episode is re-run from the start on a (restarted) env up to `env_retries` times; a job that still fails is
  reported in `RolloutResult.failed` and never as a trajectory, so it cannot enter the GRPO statistics.
- **Screen coordinates.** Coordinates: the model answers in model-image pixels (the smart_resized screenshot
  it saw, resized with its family's factor `patch_factor`: 28 for Qwen2.5-VL, 32 for Qwen3-VL) or in 0-1000
  units (coord_mode relative1000, where the factor plays no part); `to_screen` maps them to the env's screen
  before stepping, and the stored `actions_json` holds the screen coordinates actually sent.
- **Per-step sampling seeds.** Reproducible: the reply of step s of job j (its index in the job list) is
  sampled with the seed `derive_seed("sample", cfg.seed, epoch, iteration, j, s)` (seeds.py), never from its
  batch row, the round of the loop, its env or the time it ran. Which envs are free when, and so who shares a
  batch, depends on timing; the replies do not (the generator seeds each prompt on its own, generate.py,
  decision "Own decode loop"), and a re-run after an env fault draws the same seeds as a clean run. The same
  job list gives the same trajectories with 1 or 8 envs, process or Ray workers.
- **Time split.** Time is split into env (the loop blocked waiting on env calls), inference (generation) and
  the rest, so a benchmark can see who waits for whom.
- **Fault metrics.** Env faults are metrics: the pool's fault counters (pool.py, decision "Fault counting")
  during the call become `rollout/faults/<kind>` (every kind, 0 included) and
  `task/<domain>/<task_id>/env_faults`.
- **No params defaults.** `RolloutConfig` has no defaults for what params own (sampling, step limit, reply
  length, format penalty, pixel budget, coordinate mode, seed): the caller builds it from params.yaml. The
  scheduling settings (mode, batch_wait_s) change speed, never results, and default to params.yaml's values.
  `action_format` and `patch_factor` default to the Qwen2.5-VL family's UI-TARS grammar and 28, what every
  caller before Qwen3-VL policies meant; `pipeline/rollouts.py` sets both from params and the checkpoint.
- **Injectable clock.** Time and waiting go through a `Clock` (`RealClock`: time.monotonic +
  concurrent.futures.wait), so the very same loop runs under a simulated clock with fake envs and a generation
  cost model (benchmarks/rollout_sim.py, the paper's 128 OSWorld envs). `rollout/env_utilization` is the envs'
  busy time (the pool's `EnvResult.elapsed_s` of every reset, step and evaluation) over n_envs x wall
  time; `rollout/mean_batch` and `rollout/generate_calls` show how the generator was fed.
- **Ranks' job indices.** Data-parallel ranks (distributed.py, decision "Whole groups per rank") each play
  part of an iteration's job list under the jobs' indices in the WHOLE list (`orders`), so every reply draws
  its one-process seed; rank 0 merges the parts back (`merge_results`) into what one call over the whole list
  returns.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from PIL import Image

from arpo_core.actions import ACTION_FORMATS, ActionParseError, parse_reply, smart_resize, to_screen
from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.pool import EnvPool, EnvResult
from arpo_core.infra.seeds import derive_seed
from arpo_core.policy.prompt import PromptInput, Reply
from arpo_core.rewards import trajectory_reward
from arpo_core.trajectory import Step, Trajectory, png_bytes

if TYPE_CHECKING:  # torch: the generator is passed in, never built here
    from arpo_core.policy.generate import Generation, Generator

__all__ = [
    "ROLLOUT_MODES",
    "Clock",
    "EpisodeJob",
    "RealClock",
    "RolloutConfig",
    "RolloutResult",
    "episode_metrics",
    "make_group_jobs",
    "merge_results",
    "run_episodes",
]

ROLLOUT_MODES = ("sync", "async")
"""Decision "Sync and async schedules": how env steps and generation interleave within one `run_episodes`
call."""


@dataclass(frozen=True)
class RolloutConfig:
    """How episodes are played; built by the caller from params (decision "No params defaults")."""

    max_steps: int
    """Episode step limit (reference 15)."""
    temperature: float
    """Sampling temperature (0: greedy)."""
    top_p: float
    """Nucleus sampling."""
    max_new_tokens: int
    """Reply length limit in tokens."""
    format_penalty: float
    """Reward of an episode with an unparseable reply."""
    min_pixels: int
    """smart_resize lower bound of the policy's image processor (model-image coordinates)."""
    max_pixels: int
    """smart_resize upper bound of the policy's image processor."""
    coord_mode: str
    """'absolute' (UI-TARS-1.5 / Qwen2.5-VL pixels) or 'relative1000' (UI-TARS-1.0)."""
    seed: int
    """Run seed of sampling; each reply's seed derives from it (decision "Per-step sampling seeds")."""
    env_retries: int = 2
    """Re-runs of an episode hit by an env fault before it is reported failed."""
    mode: Literal["sync", "async"] = "async"
    """Decision "Sync and async schedules": `sync` (step-synchronous rounds) or `async` (an env steps as soon
    as its reply is ready). Speed only, never the episodes (decision "Per-step sampling seeds"), so, like
    env_retries, it has a default: the one of params.yaml's `env.rollout.mode`."""
    batch_wait_s: float = 0.0
    """Async mode: how long the oldest ready prompt may wait for others to join its batch (params'
    `env.rollout.batch_wait_s`)."""
    action_format: str = "uitars"
    """The reply grammar (`arpo_core.actions.ACTION_FORMATS`; params' `policy.action_format`)."""
    patch_factor: int = 28
    """smart_resize factor of the policy's model image (`Policy.patch_factor`: 28 Qwen2.5-VL, 32 Qwen3-VL)."""

    def __post_init__(self) -> None:
        if self.action_format not in ACTION_FORMATS:
            raise ValueError(f"action_format must be one of {ACTION_FORMATS}, got {self.action_format!r}")
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"rollout mode must be one of {ROLLOUT_MODES}, got {self.mode!r}")
        if self.batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {self.batch_wait_s}")


@dataclass(frozen=True)
class EpisodeJob:
    task: TaskSpec
    seed: int
    """Env seed of the episode (MiniWoB: the task instance). A pinned instance's job always carries the
    task's own seed, whatever the job builder proposed (suites.py, decision "Fixed instances"): a training
    group, a baseline row and an evaluation of `click-link@0017` all play that one instance."""
    group_id: int = 0
    sample_idx: int = 0

    def __post_init__(self) -> None:
        if self.task.seed is not None and self.seed != self.task.seed:
            object.__setattr__(self, "seed", self.task.seed)


def make_group_jobs(
    tasks: Sequence[TaskSpec],
    group_size: int,
    seed: int,
    first_group: int = 0,
    groups_per_task: int = 1,
) -> list[EpisodeJob]:
    """`groups_per_task` groups of G jobs per task, task-major and group-contiguous. Group g (counted
    over the whole list: task i's r-th group is g = i * groups_per_task + r) has group id
    `first_group + g` and env seed `seed + g`: the G samples of a group share one task instance (GRPO
    compares rollouts of the same instance, the group mean is the baseline), and each group of a task
    plays its own instance. With groups_per_task=1 this is one group per task, group g = task i."""
    jobs = []
    for i, task in enumerate(tasks):
        for r in range(groups_per_task):
            g = i * groups_per_task + r
            for k in range(group_size):
                jobs.append(EpisodeJob(task, seed=seed + g, group_id=first_group + g, sample_idx=k))
    return jobs


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]
    """Finished episodes, in job order (group-contiguous when the jobs were)."""
    failed: list[tuple[EpisodeJob, str]]
    """Jobs that hit env faults `env_retries + 1` times, with the last error, in job order."""
    metrics: dict[str, float] = field(default_factory=dict)
    orders: list[int] = field(default_factory=list)
    """Each trajectory's index in the job list its call was given (decision "Ranks' job indices": the whole
    iteration's)."""


@dataclass
class _Episode:
    job: EpisodeJob
    order: int
    """Index of the job in the job list (decision "Per-step sampling seeds")."""
    env_idx: int = -1
    attempts: int = 0
    obs: Observation | None = None
    screenshots: list[Image.Image] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    format_error: bool = False
    success: float = 0.0
    instruction: str = ""


def _model_size(screen: tuple[int, int], cfg: RolloutConfig) -> tuple[int, int]:
    h, w = smart_resize(
        screen[1], screen[0], factor=cfg.patch_factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
    )
    return (w, h)


class Clock(Protocol):
    """Time and waiting as the loop sees them (decision "Injectable clock"): the real clock, or a simulated
    one (benchmarks/rollout_sim.py) under which the same loop drives fake envs and a generation cost model."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    def wait(self, futures: Collection[Any], timeout: float | None) -> None:
        """Return once one of `futures` is done, or after `timeout` seconds (None: no limit)."""
        ...


class RealClock:
    """`time.monotonic` and `concurrent.futures.wait` (the pool's futures)."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, futures: Collection[Any], timeout: float | None) -> None:
        wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)


class _Rollout:
    """The state of one `run_episodes` call; each method is one phase of the loop
    (decision "Sync and async schedules")."""

    def __init__(
        self,
        pool: EnvPool,
        generator: Generator,
        jobs: Sequence[EpisodeJob],
        cfg: RolloutConfig,
        epoch: int,
        iteration: int,
        progress,
        clock: Clock,
        orders: Sequence[int] | None = None,
    ):
        self.pool, self.generator, self.cfg, self.clock = pool, generator, cfg, clock
        self.epoch, self.iteration, self.progress = epoch, iteration, progress
        seed_index = list(orders) if orders is not None else list(range(len(jobs)))
        if len(seed_index) != len(jobs):
            raise ValueError(f"{len(seed_index)} job indices for {len(jobs)} jobs")
        self.queue: deque[_Episode] = deque(_Episode(job, seed_index[i]) for i, job in enumerate(jobs))
        self.resets: dict[int, tuple[_Episode, Future[EnvResult]]] = {}
        self.steps: dict[int, tuple[_Episode, Future[EnvResult]]] = {}
        self.evals: dict[int, tuple[_Episode, Future[EnvResult]]] = {}
        self.ready: dict[int, tuple[_Episode, float]] = {}
        """env -> (episode whose next reply is due, since when)."""
        self.finished: list[_Episode] = []
        self.failed: list[tuple[int, EpisodeJob, str]] = []
        """(job index, job, last error) of jobs given up on, in the order they failed."""
        self.n_env_faults = 0
        self.t_env = self.t_inf = self.env_busy_s = 0.0
        self.batch_sizes: list[int] = []

    def run(self) -> None:
        for env_idx in range(self.pool.n):
            self.release(env_idx)
        while self.resets or self.steps or self.evals or self.ready:
            self.collect()
            if self.ready and self.batch_due():
                self.step(self.generate())
            elif self.resets or self.steps or self.evals:
                self.wait()

    def batch_due(self) -> bool:
        """Decision "Sync and async schedules": sync generates once no reset or step is pending (every live
        episode in one batch); async once nothing else can join soon, or the oldest waiting prompt has waited
        `batch_wait_s`."""
        if not self.resets and not self.steps:
            return True
        if self.cfg.mode == "sync":
            return False
        return self.clock.now() >= self._deadline()

    def _deadline(self) -> float:
        return min(t for _, t in self.ready.values()) + self.cfg.batch_wait_s

    def wait(self) -> None:
        """Block until an env call comes back (async with prompts waiting: at most until their deadline)."""
        pending = [f for d in (self.resets, self.steps, self.evals) for _, f in d.values()]
        timeout = None
        if self.ready and self.cfg.mode == "async":  # sync waits for every pending reset and step
            timeout = max(0.0, self._deadline() - self.clock.now())
        t0 = self.clock.now()
        self.clock.wait(pending, timeout)
        self.t_env += self.clock.now() - t0

    # ---- an env takes a job, gives one back
    def start(self, ep: _Episode, env_idx: int) -> None:
        """A fresh attempt of `ep` on `env_idx`: everything of an earlier attempt is dropped
        (decision "Env fault retries")."""
        ep.env_idx = env_idx
        ep.attempts += 1
        ep.obs, ep.screenshots, ep.replies, ep.steps = None, [], [], []
        ep.format_error, ep.success = False, 0.0
        self.resets[env_idx] = (ep, self.pool.submit_reset(env_idx, ep.job.task, ep.job.seed))

    def release(self, env_idx: int) -> None:
        """`env_idx` is free: it takes the next queued job, if any."""
        if self.queue:
            self.start(self.queue.popleft(), env_idx)

    def finish(self, ep: _Episode) -> None:
        self.finished.append(ep)
        if self.progress is not None:
            self.progress.update(1)
        self.release(ep.env_idx)

    def fault(self, ep: _Episode, error: str) -> None:
        """Decision "Env fault retries": re-run first, on the next free env (the pool restarts broken
        workers), or give up."""
        self.n_env_faults += 1
        if ep.attempts > self.cfg.env_retries:
            self.failed.append((ep.order, ep.job, error))
            if self.progress is not None:
                self.progress.update(1)
        else:
            self.queue.appendleft(ep)
        self.release(ep.env_idx)

    def _done(self, calls: dict[int, tuple[_Episode, Future[EnvResult]]]):
        """(env, episode, result) of the calls that are back, by env index; the env is busy no more."""
        for env_idx in sorted(i for i, (_, f) in calls.items() if f.done()):
            ep, fut = calls.pop(env_idx)
            res = fut.result()
            self.env_busy_s += res.elapsed_s
            yield env_idx, ep, res

    # ---- the phases of the loop
    def collect(self) -> None:
        """Route every env call that is back: evaluations end episodes (overlapping the other envs'
        steps), resets and steps make an episode's next prompt ready (or end it)."""
        for _, ep, res in self._done(self.evals):
            if res.error:
                self.fault(ep, f"evaluate: {res.error}")
            else:
                ep.success = float(res.score or 0.0)
                self.finish(ep)
        now = self.clock.now()
        for env_idx, ep, res in self._done(self.resets):
            if res.error or res.observation is None:
                self.fault(ep, f"reset: {res.error}")
            else:
                ep.obs = res.observation
                ep.instruction = res.observation.instruction or ep.job.task.instruction
                self.ready[env_idx] = (ep, now)
        for env_idx, ep, res in self._done(self.steps):
            if res.error:
                ep.steps[-1].env_error = res.error
                self.fault(ep, f"step: {res.error}")
            elif res.done or len(ep.steps) >= self.cfg.max_steps:
                ep.obs = res.observation
                ep.steps[-1].done = res.done
                self.evals[env_idx] = (ep, self.pool.submit_evaluate(env_idx))
            else:
                ep.obs = res.observation
                self.ready[env_idx] = (ep, now)

    def generate(self) -> dict[int, Generation]:
        """One batched generation for every ready episode, each reply with its own seed
        (decision "Per-step sampling seeds")."""
        order = sorted(self.ready)
        prompts, seeds = [], []
        for env_idx in order:
            ep = self.ready[env_idx][0]
            ep.screenshots.append(ep.obs.screenshot)
            prompts.append(PromptInput(ep.instruction, tuple(ep.screenshots), tuple(ep.replies)))
            seeds.append(
                derive_seed("sample", self.cfg.seed, self.epoch, self.iteration, ep.order, len(ep.steps))
            )
        self.batch_sizes.append(len(order))
        t0 = self.clock.now()
        gens = self.generator.generate(
            prompts,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_new_tokens=self.cfg.max_new_tokens,
            seeds=seeds,
        )
        self.t_inf += self.clock.now() - t0
        return dict(zip(order, gens, strict=True))

    def step(self, gens: dict[int, Generation]) -> None:
        """Record each reply and send its actions to its env at once (the loop collects the results
        later); a reply that does not parse ends its episode (decision "Format errors": no env step, no
        evaluation)."""
        for env_idx, gen in gens.items():
            ep = self.ready.pop(env_idx)[0]
            actions = self._record(ep, gen)
            if actions is None:
                self.finish(ep)
            else:
                self.steps[env_idx] = (ep, self.pool.submit_step(env_idx, actions))

    def _record(self, ep: _Episode, gen: Generation):
        """Append the step of reply `gen` to `ep`; its actions in screen pixels, or None on a format error."""
        screen = ep.obs.screen_size
        step = Step(
            step_idx=len(ep.steps),
            screenshot_png=png_bytes(ep.obs.screenshot),
            screen_w=screen[0],
            screen_h=screen[1],
            response_text=gen.text,
            gen_logprob_sum=float(sum(gen.logprobs)),
            response_token_ids=list(gen.token_ids),
        )
        ep.steps.append(step)
        ep.replies.append(Reply(gen.text, tuple(gen.token_ids)))
        try:
            parsed = parse_reply(gen.text, self.cfg.action_format)
        except ActionParseError as e:
            step.parse_ok, step.done, step.env_error = False, True, ""
            step.actions_json = json.dumps({"parse_error": str(e)})
            ep.format_error = True
            return None
        actions = to_screen(parsed.actions, _model_size(screen, self.cfg), screen, mode=self.cfg.coord_mode)
        step.actions_json = json.dumps([dataclasses.asdict(a) for a in actions])
        return actions


def _trajectory(
    ep: _Episode, cfg: RolloutConfig, run_id: str, stage: str, epoch: int, version: int
) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        stage=stage,
        epoch=epoch,
        task_domain=ep.job.task.domain,
        task_id=ep.job.task.task_id,
        instruction=ep.instruction,
        steps=ep.steps,
        group_id=ep.job.group_id,
        sample_idx=ep.job.sample_idx,
        success=ep.success,
        reward=trajectory_reward(ep.success, ep.format_error, cfg.format_penalty),
        replayed=False,
        policy_version=version,
    )


def run_episodes(
    pool: EnvPool,
    generator: Generator,
    jobs: Sequence[EpisodeJob],
    cfg: RolloutConfig,
    *,
    run_id: str = "",
    stage: str = "rollout",
    epoch: int = 0,
    iteration: int = 0,
    policy_version: int = 0,
    progress=None,
    clock: Clock | None = None,
    orders: Sequence[int] | None = None,
) -> RolloutResult:
    """Run every job to completion over `pool` (decision "Sync and async schedules"). `epoch` and `iteration`
    name this call in the sampling seeds (decision "Per-step sampling seeds"): two calls with the same job
    list, config, epoch and iteration give the same episodes. `progress` (tqdm-like, optional) is advanced by
    one per finished episode. `clock`: the loop's time and waiting (decision "Injectable clock"; default the
    real clock). `orders`: each job's index in the whole iteration's job list when `jobs` is a data-parallel
    rank's part of it (decision "Ranks' job indices"); default their positions in `jobs`."""
    clock = clock or RealClock()
    t_start = clock.now()
    faults_before = _faults(pool)
    r = _Rollout(pool, generator, jobs, cfg, epoch, iteration, progress, clock, orders)
    r.run()
    faults_after = _faults(pool)
    done = sorted(r.finished, key=lambda e: e.order)
    trajs = [_trajectory(ep, cfg, run_id, stage, epoch, policy_version) for ep in done]
    failed = [(job, error) for _, job, error in sorted(r.failed, key=lambda f: f[0])]  # job order too
    total = clock.now() - t_start
    metrics = {
        **episode_metrics(trajs),
        "rollout/env_faults": float(r.n_env_faults),
        "rollout/failed_jobs": float(len(r.failed)),
        "time/rollout_s": total,
        "time/env_wait_s": r.t_env,
        "time/inference_s": r.t_inf,
        "time/other_s": max(0.0, total - r.t_env - r.t_inf),
        "time/env_busy_s": r.env_busy_s,
        "rollout/env_utilization": r.env_busy_s / (pool.n * total) if total > 0 else 0.0,
        "rollout/generate_calls": float(len(r.batch_sizes)),
        "rollout/mean_batch": sum(r.batch_sizes) / max(1, len(r.batch_sizes)),
    }
    metrics.update(_fault_metrics(faults_before, faults_after))
    return RolloutResult(trajs, failed, metrics, [ep.order for ep in done])


def episode_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The `rollout/*` rates of finished episodes (0.0 placeholders when there is none)."""
    n = max(1, len(trajs))
    return {
        "rollout/episodes": float(len(trajs)),
        "rollout/success_rate": sum(t.success for t in trajs) / n,
        "rollout/format_error_rate": sum(t.format_error for t in trajs) / n,
        "rollout/mean_steps": sum(len(t.steps) for t in trajs) / n,
        "rollout/mean_reward": sum(t.reward for t in trajs) / n,
    }


def merge_results(parts: Sequence[RolloutResult]) -> RolloutResult:
    """Decision "Ranks' job indices": the data-parallel ranks' results of one iteration as one call's would
    be: episodes
    back in job order, failures in job order, episode rates recomputed over all episodes, counts summed,
    times the slowest rank's, utilisation the ranks' mean, batch size weighted by generate calls."""
    if len(parts) == 1:
        return parts[0]
    pairs = [(o, t) for part in parts for o, t in zip(part.orders, part.trajectories, strict=True)]
    ordered = sorted(pairs, key=lambda pair: pair[0])
    trajs = [t for _, t in ordered]
    failed = sorted(
        (f for part in parts for f in part.failed), key=lambda f: (f[0].group_id, f[0].sample_idx)
    )
    metrics: dict[str, float] = {}
    for key in sorted({k for part in parts for k in part.metrics}):
        values = [part.metrics[key] for part in parts if key in part.metrics]
        if key.startswith("time/"):
            metrics[key] = max(values)
        elif key == "rollout/env_utilization":
            metrics[key] = sum(values) / len(values)
        elif key == "rollout/mean_batch":
            calls = [part.metrics.get("rollout/generate_calls", 0.0) for part in parts if key in part.metrics]
            metrics[key] = sum(v * c for v, c in zip(values, calls, strict=True)) / max(1.0, sum(calls))
        else:  # counts: env faults, failed jobs, generate calls, per-task faults
            metrics[key] = float(sum(values))
    metrics.update(episode_metrics(trajs))
    return RolloutResult(trajs, failed, metrics, [o for o, _ in ordered])


def _faults(pool) -> tuple[dict[str, int], dict[tuple[str, str], dict[str, int]]]:
    """The pool's fault counters (pool.py, decision "Fault counting"), empty for a pool-like object without
    them."""
    counts = getattr(pool, "fault_counts", None)
    per_task = getattr(pool, "task_fault_counts", None)
    return (counts() if counts else {}), (per_task() if per_task else {})


def _fault_metrics(before, after) -> dict[str, float]:
    """Decision "Fault metrics": `rollout/faults/<kind>` for every kind and
    `task/<domain>/<task_id>/env_faults` for each task with a fault, counted during this call."""
    out = {f"rollout/faults/{k}": float(v - before[0].get(k, 0)) for k, v in after[0].items()}
    for key, kinds in after[1].items():
        old = before[1].get(key, {})
        n = sum(v - old.get(k, 0) for k, v in kinds.items())
        if n:
            out[f"task/{_clean(key[0])}/{_clean(key[1])}/env_faults"] = float(n)
    return out


def _clean(name: str) -> str:
    """MLflow's key alphabet (the trainer's and evaluate's per-task keys): anything else becomes '_'."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)
