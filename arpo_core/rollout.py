"""Groups of episodes over an env pool with batched inference (docs/method.md §1, "Rollout system").

Decisions:
1. Step-synchronous: every live episode's prompt goes to the generator as ONE batch, the parsed actions
   go back to the envs in parallel, and the loop waits for those steps. Episodes do not wait for each
   other otherwise: a finished episode is evaluated at once through the pool's futures while the others
   keep stepping, and its env immediately takes the next queued job (the per-env executor runs the
   reset after the evaluation), so with more jobs than envs no env idles until the queue is empty.
2. A reply that does not parse is a format error: the step is recorded (parse_ok False), the episode
   ends without touching the env, success is 0 and the reward gets the format penalty (docs/method.md §1).
   Model text is never executed: it goes through `parse_response` only.
3. Env faults (timeout, crashed browser, failed reset) are not policy failures: the episode is re-run
   from the start on a (restarted) env up to `env_retries` times; a job that still fails is reported in
   `RolloutResult.failed` and never as a trajectory, so it cannot enter the GRPO statistics.
4. Coordinates: the model answers in model-image pixels (the smart_resized screenshot it saw);
   `to_screen` maps them to the env's screen before stepping, and the stored `actions_json` holds the
   screen coordinates actually sent.
5. Sampling seeds are derived from (seed, round): reproducible for a fixed job list and pool size.
6. Time is split into env (waiting on env futures), inference (generation) and the rest, so a
   benchmark can see who waits for whom.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from PIL import Image

from arpo_core.actions import ActionParseError, parse_response, smart_resize, to_screen
from arpo_core.envs.base import Observation, TaskSpec
from arpo_core.envs.pool import EnvPool, EnvResult
from arpo_core.policy.generate import Generation, Generator
from arpo_core.policy.prompt import PromptInput, Reply
from arpo_core.rewards import trajectory_reward
from arpo_core.trajectory import Step, Trajectory, png_bytes

__all__ = ["EpisodeJob", "RolloutConfig", "RolloutResult", "make_group_jobs", "run_episodes"]


@dataclass(frozen=True)
class RolloutConfig:
    max_steps: int = 15
    """Episode step limit (reference 15)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_new_tokens: int = 96
    """Reply length limit in tokens."""
    format_penalty: float = -1.0
    """Reward of an episode with an unparseable reply."""
    min_pixels: int = 3136
    """smart_resize lower bound of the policy's image processor (model-image coordinates)."""
    max_pixels: int = 1003520
    """smart_resize upper bound of the policy's image processor."""
    coord_mode: str = "absolute"
    """'absolute' (UI-TARS-1.5 / Qwen2.5-VL pixels) or 'relative1000' (UI-TARS-1.0)."""
    env_retries: int = 2
    """Re-runs of an episode hit by an env fault before it is reported failed."""
    seed: int = 0
    """Base seed of sampling."""


@dataclass(frozen=True)
class EpisodeJob:
    task: TaskSpec
    seed: int
    """Env seed of the episode (MiniWoB: the task instance)."""
    group_id: int = 0
    sample_idx: int = 0


def make_group_jobs(
    tasks: Sequence[TaskSpec], group_size: int, seed: int, first_group: int = 0
) -> list[EpisodeJob]:
    """G jobs per task, group-contiguous. The G samples of a group share one env seed: GRPO compares
    rollouts of the same task instance (the group mean is the baseline)."""
    jobs = []
    for g, task in enumerate(tasks):
        for k in range(group_size):
            jobs.append(EpisodeJob(task, seed=seed + g, group_id=first_group + g, sample_idx=k))
    return jobs


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]
    """Finished episodes, in job order (group-contiguous when the jobs were)."""
    failed: list[tuple[EpisodeJob, str]]
    """Jobs that hit env faults `env_retries + 1` times, with the last error."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Episode:
    job: EpisodeJob
    order: int
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
    h, w = smart_resize(screen[1], screen[0], min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return (w, h)


def run_episodes(
    pool: EnvPool,
    generator: Generator,
    jobs: Sequence[EpisodeJob],
    cfg: RolloutConfig,
    *,
    run_id: str = "",
    stage: str = "rollout",
    epoch: int = 0,
    policy_version: int = 0,
    progress=None,
) -> RolloutResult:
    """Run every job to completion over `pool` (decision 1). `progress` (tqdm-like, optional) is
    advanced by one per finished episode."""
    t_start = time.monotonic()
    t_env = t_inf = 0.0
    queue: deque[_Episode] = deque(_Episode(job, i) for i, job in enumerate(jobs))
    free = list(range(pool.n))
    resets: dict[int, tuple[_Episode, Future[EnvResult]]] = {}
    evals: dict[int, tuple[_Episode, Future[EnvResult]]] = {}
    live: dict[int, _Episode] = {}
    finished: list[_Episode] = []
    failed: list[tuple[EpisodeJob, str]] = []
    n_env_faults = 0
    rounds = 0

    def start(ep: _Episode, env_idx: int) -> None:
        ep.env_idx = env_idx
        ep.attempts += 1
        ep.obs, ep.screenshots, ep.replies, ep.steps = None, [], [], []
        ep.format_error, ep.success = False, 0.0
        resets[env_idx] = (ep, pool.submit_reset(env_idx, ep.job.task, ep.job.seed))

    def fault(ep: _Episode, error: str) -> None:
        nonlocal n_env_faults
        n_env_faults += 1
        if ep.attempts > cfg.env_retries:
            failed.append((ep.job, error))
            if progress is not None:
                progress.update(1)
        else:
            queue.appendleft(ep)  # re-run first, on the next free env (the pool restarts broken workers)

    def release(env_idx: int) -> None:
        if queue:
            start(queue.popleft(), env_idx)
        else:
            free.append(env_idx)

    while free and queue:
        start(queue.popleft(), free.pop(0))

    while resets or evals or live:
        # 1. Collect evaluations that are done (they overlap the other envs' steps).
        for env_idx in [i for i, (_, f) in evals.items() if f.done()]:
            ep, fut = evals.pop(env_idx)
            res = fut.result()
            if res.error:
                fault(ep, f"evaluate: {res.error}")
            else:
                ep.success = float(res.score or 0.0)
                finished.append(ep)
                if progress is not None:
                    progress.update(1)
            release(env_idx)
        # 2. Resets (new episodes) must land before their first generation.
        t0 = time.monotonic()
        for env_idx in list(resets):
            ep, fut = resets.pop(env_idx)
            res = fut.result()
            if res.error or res.observation is None:
                fault(ep, f"reset: {res.error}")
                release(env_idx)
            else:
                ep.obs = res.observation
                ep.instruction = res.observation.instruction or ep.job.task.instruction
                live[env_idx] = ep
        t_env += time.monotonic() - t0
        if not live:
            if evals:
                t0 = time.monotonic()
                next(iter(evals.values()))[1].result()
                t_env += time.monotonic() - t0
            continue

        # 3. One batched generation for every live episode.
        order = sorted(live)
        prompts = []
        for env_idx in order:
            ep = live[env_idx]
            ep.screenshots.append(ep.obs.screenshot)
            prompts.append(PromptInput(ep.instruction, tuple(ep.screenshots), tuple(ep.replies)))
        t0 = time.monotonic()
        gens: list[Generation] = generator.generate(
            prompts,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed * 1_000_003 + epoch * 10_007 + rounds * 101,
        )
        t_inf += time.monotonic() - t0
        rounds += 1

        # 4. Parse; step the envs whose replies parsed, in parallel.
        steps: dict[int, Future[EnvResult]] = {}
        for env_idx, gen in zip(order, gens, strict=True):
            ep = live[env_idx]
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
                parsed = parse_response(gen.text)
            except ActionParseError as e:
                step.parse_ok, step.done, step.env_error = False, True, ""
                step.actions_json = json.dumps({"parse_error": str(e)})
                ep.format_error = True
                continue
            actions = to_screen(parsed.actions, _model_size(screen, cfg), screen, mode=cfg.coord_mode)
            step.actions_json = json.dumps([dataclasses.asdict(a) for a in actions])
            steps[env_idx] = pool.submit_step(env_idx, actions)

        t0 = time.monotonic()
        for env_idx in order:
            ep = live.pop(env_idx)
            if ep.format_error:  # decision 2: no env step, no evaluation
                finished.append(ep)
                if progress is not None:
                    progress.update(1)
                release(env_idx)
                continue
            res = steps[env_idx].result()
            if res.error:
                ep.steps[-1].env_error = res.error
                fault(ep, f"step: {res.error}")
                release(env_idx)
                continue
            ep.obs = res.observation
            if res.done or len(ep.steps) >= cfg.max_steps:
                ep.steps[-1].done = res.done
                evals[env_idx] = (ep, pool.submit_evaluate(env_idx))
            else:
                live[env_idx] = ep
        t_env += time.monotonic() - t0

    trajs = []
    for ep in sorted(finished, key=lambda e: e.order):
        reward = trajectory_reward(ep.success, ep.format_error, cfg.format_penalty)
        trajs.append(
            Trajectory(
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
                reward=reward,
                replayed=False,
                policy_version=policy_version,
            )
        )
    total = time.monotonic() - t_start
    n = max(1, len(trajs))
    metrics = {
        "rollout/episodes": float(len(trajs)),
        "rollout/success_rate": sum(t.success for t in trajs) / n,
        "rollout/format_error_rate": sum(t.format_error for t in trajs) / n,
        "rollout/mean_steps": sum(len(t.steps) for t in trajs) / n,
        "rollout/mean_reward": sum(t.reward for t in trajs) / n,
        "rollout/env_faults": float(n_env_faults),
        "rollout/failed_jobs": float(len(failed)),
        "time/rollout_s": total,
        "time/env_wait_s": t_env,
        "time/inference_s": t_inf,
        "time/other_s": max(0.0, total - t_env - t_inf),
    }
    return RolloutResult(trajs, failed, metrics)
