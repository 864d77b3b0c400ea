"""Prefect tasks around the pipeline stages: one task per row of the stage table, paths in, metrics back.

Decisions:
1. Thin: a task imports the stage's module (`arpo_core.pipeline.<module>`) and calls its `run` with the
   params and the keyword arguments the stage table gives (paths under the project root). No logic lives
   here that `arpo stage NAME` would miss.
2. Retries with exponential back-off only for stages the table marks `envs` (browsers crash, a reset
   times out). Building the policy, grounding, SFT and task selection are deterministic CPU work; a
   failure there is a bug, and retrying would hide it. The train stage retries by resuming from its last
   epoch checkpoint, so a retry does not repeat finished epochs.
3. No Prefect result caching (`NO_CACHE`): whether a stage is up to date is decided by the pipeline
   flow from params, inputs and code (flows/spec.py), the same rule as DVC's.
4. Per-iteration metrics leave through the `on_metrics(step, metrics)` hook the caller passes (the flow
   layer logs them to MLflow); this module knows nothing of tracking.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from arpo_core.config import Params
from arpo_core.pipeline.table import STAGES, Stage, stage

__all__ = ["ENV_RETRIES", "TASKS", "run_stage"]

ENV_RETRIES = {
    "retries": 2,
    "retry_delay_seconds": exponential_backoff(backoff_factor=10),
    "retry_jitter_factor": 0.5,
}


def run_stage(
    name: str,
    p: Params,
    root: Path = Path("."),
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Run stage `name`'s `run(p, **table arguments)` (decision 1); returns its metrics."""
    s = stage(name)
    module = importlib.import_module(f"arpo_core.pipeline.{s.module}")
    kwargs = s.kwargs(root)
    if s.iterations:
        kwargs["on_metrics"] = on_metrics
    return module.run(p, **kwargs)


def _task(s: Stage) -> Task:
    options = ENV_RETRIES if s.envs else {}
    return task(run_stage, name=f"run-{s.name}", cache_policy=NO_CACHE, **options)


TASKS: dict[str, Task] = {s.name: _task(s) for s in STAGES}
"""One Prefect task per stage (decision 2: retries only where the table says `envs`)."""
