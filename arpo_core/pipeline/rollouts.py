"""Env pools and rollout settings of the stages that play episodes (demos, baseline, train, the offline
stages' and evaluate's evaluations, compare's targets).

Decisions:
1. Env pools are created and closed inside the stage that needs them (`make_pool` is a context manager),
   so no browser or worker process outlives a stage.
2. `rollout_config` is the one place where a `RolloutConfig` is assembled from params: the sampling
   values of the calling stage (temperature, step limit), the shared `policy` section, the format penalty
   of `train.loss` and the pixel budget of the checkpoint itself (its image processor config), so the
   model-image coordinates of a rollout are always those of the policy that plays it.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path

from arpo_core.config import Params
from arpo_core.envs.pool import EnvPool
from arpo_core.pipeline.common import pixel_budget
from arpo_core.rollout import RolloutConfig

__all__ = ["make_pool", "rollout_config"]


@contextmanager
def make_pool(p: Params, n: int | None = None):
    """An EnvPool of MiniWoB envs (the embedded default), closed on exit (decision 1)."""
    from arpo_core.envs.miniwob import make_miniwob_env

    factory = functools.partial(make_miniwob_env, episode_time_limit_s=p.env.episode_time_limit_s)
    pool = EnvPool(
        factory,
        n=n or p.env.n_envs,
        backend=p.env.backend,
        reset_timeout_s=p.env.reset_timeout_s,
        step_timeout_s=p.env.step_timeout_s,
        eval_timeout_s=p.env.eval_timeout_s,
        reset_retries=p.env.reset_retries,
        ray_resources=p.env.ray_resources or None,
    )
    try:
        yield pool
    finally:
        pool.close()


def rollout_config(
    p: Params, policy_dir: Path, temperature: float, max_steps: int, seed: int
) -> RolloutConfig:
    """Decision 2: the rollout settings of a stage's episodes played by the checkpoint at `policy_dir`."""
    min_pixels, max_pixels = pixel_budget(policy_dir)
    return RolloutConfig(
        max_steps=max_steps,
        temperature=temperature,
        top_p=p.train.top_p,
        max_new_tokens=p.policy.max_new_tokens,
        format_penalty=p.train.loss.format_penalty,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        coord_mode=p.policy.coord_mode,
        seed=seed,
    )
