"""Prefect tasks around the pipeline stages: one task per row of the stage table, paths in, metrics back.

Decisions:
- **Thin tasks.** Thin: a task calls the stage object's `run` (arpo_core/pipeline/stage.py) with the params
  and the keyword arguments the stage table gives (paths under the project root). No logic lives
  here that `arpo stage NAME` would miss.
- **Env-stage retries.** Retries with exponential back-off only for stages the table marks `envs` (browsers
  crash, a reset times out). Building the policy, grounding, SFT and task selection are deterministic CPU
  work; a failure there is a bug, and retrying would hide it. The train stage retries by resuming from its
  last epoch checkpoint, so a retry does not repeat finished epochs.
- **No result caching.** No Prefect result caching (`NO_CACHE`): whether a stage is up to date is decided by
  the pipeline flow from params, inputs and code (flows/spec.py), the same rule as DVC's.
- **Metrics hook.** Per-iteration metrics leave through the `on_metrics(step, metrics)` hook the caller passes
  (the flow layer logs them to MLflow); this module knows nothing of tracking.
- **Non-retryable errors.** Even an env stage is not retried when its error is one a retry cannot fix
  (`arpo_core.infra.errors` `retryable`: disk full, an unwritable output, a truncated or unreadable input):
  the same attempt would meet the same disk or file, after minutes of back-off and with the error printed
  three times. Prefect hands the condition the failed state; an exception raised by the task is its `data`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.tasks import exponential_backoff

from arpo_core.config import Params
from arpo_core.infra.errors import retryable
from arpo_core.pipeline.table import STAGES, Stage, stage

__all__ = ["ENV_RETRIES", "TASKS", "retry_unless_not_retryable", "run_stage"]

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
    outputs: Mapping[str, Path] | None = None,
) -> dict[str, Any]:
    """Run stage `name`'s `run(p, **table arguments)` (decision "Thin tasks"); returns its metrics. `outputs`
    replaces the table's output paths (the runner's staging paths, flows/runner.py,
    decision "Staged outputs")."""
    s = stage(name)
    kwargs = s.kwargs(root) | dict(outputs or {})
    if s.iterations or s.progress:
        kwargs["on_metrics"] = on_metrics
    return s.run(p, **kwargs)


def retry_unless_not_retryable(task: Task, task_run: Any, state: State) -> bool:
    """Decision "Non-retryable errors": Prefect's `retry_condition_fn`: retry unless the failure is one a
    retry cannot fix (arpo_core.infra.errors: disk full, bad or corrupted input)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is None or retryable(exc)


def _task(s: Stage) -> Task:
    options = {**ENV_RETRIES, "retry_condition_fn": retry_unless_not_retryable} if s.envs else {}
    return task(run_stage, name=f"run-{s.name}", cache_policy=NO_CACHE, **options)


TASKS: dict[str, Task] = {s.name: _task(s) for s in STAGES}
"""One Prefect task per stage (decision "Env-stage retries": retries only where the table says `envs`)."""
