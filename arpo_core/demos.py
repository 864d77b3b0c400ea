"""Scripted demonstrations: the DOM oracles play seeded episodes through the env pool, and their
UI-TARS replies become trajectories for behaviour cloning (docs/design.md stage `demos`).

Decisions:
1. The oracle runs inside the env worker (`oracle_reply` reads the DOM there) and writes its reply in
   the model-image frame of the policy's pixel budget; the reply travels as text and goes through the
   same parser and coordinate mapping as a policy's reply, so a demo is exactly what the policy
   should have said.
2. Only successful episodes are kept: a demo that failed teaches the wrong thing. Failures and env
   faults are counted and returned so a broken oracle is visible (the oracles reach 20/20 in tests).
3. Each env works through its own queue of jobs in a thread; calls to one env are sequential, envs run
   in parallel (the pool's per-env executors).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from arpo_core.actions import ActionParseError, parse_response, smart_resize, to_screen
from arpo_core.envs.oracles import MODEL_MAX_PIXELS, MODEL_MIN_PIXELS
from arpo_core.envs.pool import EnvPool
from arpo_core.rollout import EpisodeJob
from arpo_core.trajectory import Step, Trajectory, png_bytes

__all__ = ["DemoResult", "play_oracle_episodes"]


@dataclasses.dataclass
class DemoResult:
    trajectories: list[Trajectory]
    """Successful demos, in job order."""
    n_failed: int
    """Episodes the oracle played to the end without success."""
    errors: list[str]
    """Env faults / missing oracles, one line each."""


def _play(
    pool: EnvPool,
    env_idx: int,
    job: EpisodeJob,
    max_steps: int,
    min_pixels: int | None,
    max_pixels: int | None,
):
    res = pool.submit_reset(env_idx, job.task, job.seed).result()
    if res.error or res.observation is None:
        return None, f"{job.task.task_id} seed {job.seed}: reset: {res.error}"
    obs = res.observation
    instruction = obs.instruction or job.task.instruction
    steps: list[Step] = []
    for k in range(max_steps):
        reply = pool.submit_call(env_idx, "oracle_reply", min_pixels, max_pixels).result()
        if reply.error or not reply.value:
            return None, f"{job.task.task_id} seed {job.seed}: no oracle reply ({reply.error})"
        text = reply.value
        try:
            parsed = parse_response(text)
        except ActionParseError as e:
            return None, f"{job.task.task_id}: oracle reply does not parse: {e}"
        w, h = obs.screen_size
        mh, mw = smart_resize(
            h, w, min_pixels=min_pixels or MODEL_MIN_PIXELS, max_pixels=max_pixels or MODEL_MAX_PIXELS
        )
        actions = to_screen(parsed.actions, (mw, mh), (w, h))
        step = Step(
            step_idx=k,
            screenshot_png=png_bytes(obs.screenshot),
            screen_w=w,
            screen_h=h,
            response_text=text,
            actions_json=json.dumps([dataclasses.asdict(a) for a in actions]),
        )
        steps.append(step)
        out = pool.submit_step(env_idx, actions).result()
        if out.error:
            return None, f"{job.task.task_id} seed {job.seed}: step: {out.error}"
        if out.done:
            step.done = True
            break
        obs = out.observation
    score = pool.submit_evaluate(env_idx).result()
    if score.error:
        return None, f"{job.task.task_id} seed {job.seed}: evaluate: {score.error}"
    traj = Trajectory(
        run_id="demos",
        stage="demos",
        epoch=0,
        task_domain=job.task.domain,
        task_id=job.task.task_id,
        instruction=instruction,
        steps=steps,
        group_id=job.group_id,
        sample_idx=job.sample_idx,
        success=float(score.score or 0.0),
        reward=float(score.score or 0.0),
    )
    return traj, None


def play_oracle_episodes(
    pool: EnvPool,
    jobs: Sequence[EpisodeJob],
    *,
    max_steps: int,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    progress=None,
) -> DemoResult:
    """Play every job with the oracle, at most `max_steps` steps each (params own the limit); keep the
    successes (decision 2). `min_pixels`/`max_pixels`: the policy's pixel budget (None: the oracles')."""
    queues: list[list[tuple[int, EpisodeJob]]] = [[] for _ in range(pool.n)]
    for i, job in enumerate(jobs):
        queues[i % pool.n].append((i, job))
    results: dict[int, Trajectory] = {}
    errors: list[str] = []
    n_failed = 0

    def work(env_idx: int) -> None:
        nonlocal n_failed
        for i, job in queues[env_idx]:
            traj, err = _play(pool, env_idx, job, max_steps, min_pixels, max_pixels)
            if err:
                errors.append(err)
            elif traj.success > 0:
                results[i] = traj
            else:
                n_failed += 1
            if progress is not None:
                progress.update(1)

    with ThreadPoolExecutor(pool.n) as ex:
        list(ex.map(work, range(pool.n)))
    return DemoResult([results[i] for i in sorted(results)], n_failed, errors)
