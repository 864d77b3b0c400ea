"""Env pools and rollout settings of the stages that play episodes (demos, baseline, train, the offline
stages' and evaluate's evaluations, compare's targets).

Decisions:
- **Stage-scoped pools.** Env pools are created and closed inside the stage that needs them (`make_pool` is a
  context manager), so no browser or worker process outlives a stage.
- **One rollout config.** `rollout_config` is the one place where a `RolloutConfig` is assembled from params:
  the sampling values of the calling stage (temperature, top_p, step limit), the shared `policy` section, the
  format penalty of `train.loss` and the pixel budget and resize factor of the checkpoint itself (its image
  processor config), so the model-image coordinates of a rollout are always those of the policy that plays it
  (Qwen2.5-VL or Qwen3-VL); and the schedule (`env.rollout`: sync or async, batch wait), which train, evaluate
  and baseline all use.
- **Generator from params.** The generator comes from the params too (`generator`): `policy.backend` hf or
  vllm (arpo_core/policy/generate.py, decisions "Generator backends", "vLLM log-probs" and "One vLLM engine"),
  built for the checkpoint the stage plays.
- **Envs from params.** The envs come from the params, never from the stage: `ENV_FACTORIES` maps `env.kind`
  to a builder of the pool's picklable env factory (MiniWoB pages, or OSWorld desktops from `env.osworld`: the
  local Xvfb desktop, running OSWorld servers, or the official desktop-env bridge). Remote servers are
  health-checked before the pool starts, so a dead URL is one clear error naming it, not eight reset
  retries per worker. The pool (process or Ray backend, `env.ray_resources`, timeouts) is the same for
  every kind.
- **Pool-life faults.** A stage's env faults are metrics over the pool's whole life, its close included
  (`pool_faults`, read after the `with make_pool(...)` block): a worker or browser that died after its last
  call is found only when the pool closes, after the last rollout's own `rollout/faults/*` were taken.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from arpo_core.algorithm.rollout import RolloutConfig
from arpo_core.config import Params
from arpo_core.envs.pool import EnvFactory, EnvPool
from arpo_core.pipeline.policies import patch_factor, pixel_budget

__all__ = [
    "ENV_FACTORIES",
    "generator",
    "make_pool",
    "miniwob_factory",
    "osworld_factory",
    "pool_faults",
    "rollout_config",
]


def miniwob_factory(p: Params) -> EnvFactory:
    """MiniWoB++ pages in headless Chromium, with the params' episode clock."""
    from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env

    return functools.partial(make_miniwob_env, episode_time_limit_s=p.env.episode_time_limit_s)


def osworld_factory(p: Params) -> EnvFactory:
    """OSWorld desktops of `env.osworld.provider` (decision "Envs from params"); remote URLs must answer
    first."""
    o = p.env.osworld
    if o.provider == "desktop_env":
        from arpo_core.envs.osworld.desktop_env_bridge import make_desktop_env_bridge_env

        return functools.partial(
            make_desktop_env_bridge_env,
            python=o.desktop_env_python,
            serve_args=list(o.desktop_env_args),
            pause_s=o.settle_s,
            start_timeout_s=o.desktop_env_timeout_s,
            call_timeout_s=o.desktop_env_timeout_s,
        )
    from arpo_core.envs.osworld.osworld_env import check_desktops, make_osworld_env

    if o.provider == "remote":
        check_desktops(o.base_urls, o.token, o.health_timeout_s)
    return functools.partial(
        make_osworld_env,
        provider=o.provider,
        base_urls=tuple(o.base_urls),
        token=o.token,
        claim_dir=o.claim_dir,
        screen_size=(o.screen_width, o.screen_height),
        settle_s=o.settle_s,
        setup_settle_s=o.setup_settle_s,
        wait_s=o.wait_s,
        command_timeout_s=o.command_timeout_s,
        download_cache_dir=o.download_cache_dir,
    )


ENV_FACTORIES: dict[str, Callable[[Params], EnvFactory]] = {
    "miniwob": miniwob_factory,
    "osworld": osworld_factory,
}
"""`env.kind` -> builder of the pool's env factory (decision "Envs from params")."""


@contextmanager
def make_pool(p: Params, n: int | None = None):
    """An EnvPool of `p.env.kind` envs (decision "Envs from params"), `n` of them (default `env.n_envs`),
    closed on exit (decision "Stage-scoped pools")."""
    factory = ENV_FACTORIES[p.env.kind](p)
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
        faults = {k: v for k, v in pool.fault_counts().items() if v}
        if faults:
            # the stage's total, beside one warning line per fault (pool.py, decision "Fault counting")
            logging.getLogger("arpo.envs").warning(
                "env faults in this stage: %s", ", ".join(f"{k}={v}" for k, v in faults.items())
            )


def pool_faults(pool: EnvPool, prefix: str) -> dict[str, float]:
    """Decision "Pool-life faults": `{prefix}/<kind>` for every fault kind the pool counted (0 included)."""
    return {f"{prefix}/{kind}": float(n) for kind, n in pool.fault_counts().items()}


def rollout_config(
    p: Params, policy_dir: Path, temperature: float, top_p: float, max_steps: int, seed: int
) -> RolloutConfig:
    """Decision "One rollout config": the rollout settings of a stage's episodes played by the checkpoint at
    `policy_dir`; the sampling settings (temperature, top_p, step limit, seed) are the calling stage's own."""
    min_pixels, max_pixels = pixel_budget(policy_dir)
    return RolloutConfig(
        action_format=p.policy.action_format,
        patch_factor=patch_factor(policy_dir),
        max_steps=max_steps,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=p.policy.max_new_tokens,
        format_penalty=p.train.loss.format_penalty,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        coord_mode=p.policy.coord_mode,
        seed=seed,
        mode=p.env.rollout.mode,
        batch_wait_s=p.env.rollout.batch_wait_s,
    )


def generator(p: Params, policy: Any, policy_dir: Path) -> Any:
    """Decision "Generator from params": the `policy.backend` generator of `policy` (loaded from
    `policy_dir`). A vLLM engine takes up to the longest step limit of baseline, train and evaluate in
    screenshots per prompt (one engine serves them all in a process, generate.py,
    decision "One vLLM engine")."""
    from arpo_core.policy.generate import make_generator

    steps = max(p.baseline.max_steps, p.train.max_steps, p.evaluate.max_steps)
    return make_generator(policy, policy_dir, p.policy, max_images=steps)
