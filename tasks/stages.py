"""Prefect tasks around the pipeline stages of `arpo_core.stages`: paths in, paths out, metrics back.

Decisions:
1. Thin: each task calls one `arpo_core.stages` function with the default paths the flow gives it and
   returns that function's flat metrics dict. No logic lives here that `arpo stage NAME` would miss.
2. Retries with exponential back-off only where environments are involved (browsers crash, a reset
   times out): demos, baseline, train rollouts and evaluation. Building the policy, SFT and task
   selection are deterministic CPU work; a failure there is a bug, and retrying would hide it.
   Grounding is CPU work too: its one browser only reads a few MiniWoB screens before and after
   training, and a retry would repeat the whole training (it has no resume), so it is not retried.
   The train task retries by resuming from its last epoch checkpoint (the stage resumes by default),
   so a retry does not repeat finished epochs.
3. No Prefect result caching (`NO_CACHE`): whether a stage is up to date is decided by the pipeline
   flow from params, inputs and code (flows/spec.py), the same rule as DVC's.
4. Per-iteration training metrics reach MLflow through a callback built here from the run id (the
   library only offers `on_iteration`); they are logged under `iter/<key>` with step = iteration
   count, next to the per-epoch series under the plain keys (flows/runner.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from arpo_core import stages
from arpo_core.config import Params

__all__ = [
    "build_policy",
    "clone_behaviour",
    "evaluate_policies",
    "ground_policy",
    "play_demos",
    "roll_out_baseline",
    "select_tasks",
    "train_policy",
]

ENV_RETRIES = {
    "retries": 2,
    "retry_delay_seconds": exponential_backoff(backoff_factor=10),
    "retry_jitter_factor": 0.5,
}


@task(cache_policy=NO_CACHE)
def build_policy(p: Params, out_dir: Path) -> dict[str, float]:
    """Build the tiny offline policy (or point at a pretrained checkpoint)."""
    return stages.init_policy(p, out_dir)


@task(cache_policy=NO_CACHE)
def ground_policy(p: Params, policy_dir: Path, out_dir: Path) -> dict[str, float]:
    """Grounding pretraining (or the versioned grounded checkpoint) plus its held-out measures."""
    return stages.ground(p, policy_dir, out_dir)


@task(cache_policy=NO_CACHE, **ENV_RETRIES)
def play_demos(p: Params, out_path: Path) -> dict[str, float]:
    """Scripted oracles play the in-domain suite; successful episodes to Parquet."""
    return stages.demos(p, out_path)


@task(cache_policy=NO_CACHE)
def clone_behaviour(p: Params, policy_dir: Path, demos_path: Path, out_dir: Path) -> dict[str, float]:
    """Behaviour cloning on the demos: the base policy."""
    return stages.sft_stage(p, policy_dir, demos_path, out_dir)


@task(cache_policy=NO_CACHE, **ENV_RETRIES)
def roll_out_baseline(p: Params, policy_dir: Path, out_dir: Path) -> dict[str, float]:
    """N sampled rollouts per in-domain task of the base policy."""
    return stages.baseline(p, policy_dir, out_dir)


@task(cache_policy=NO_CACHE)
def select_tasks(p: Params, baseline_dir: Path, out_path: Path) -> dict[str, float]:
    """Valuable task selection from the baseline rollouts."""
    return stages.select(p, baseline_dir, out_path)


def iterations_per_epoch(p: Params, selected_path: Path) -> int:
    """Rollout iterations in one epoch: ceil(tasks trained on / tasks_per_iteration)."""
    from arpo_core.selection import read_selection

    tasks = stages.suite_tasks(p, "in_domain")
    if p.train.use_selection and selected_path.exists():
        keep = {tuple(k) for k in read_selection(selected_path).kept}
        tasks = [t for t in tasks if t.key in keep]
    return max(1, math.ceil(len(tasks) / p.train.tasks_per_iteration))


@task(cache_policy=NO_CACHE, **ENV_RETRIES)
def train_policy(
    p: Params, policy_dir: Path, selected_path: Path, out_dir: Path, mlflow_run_id: str | None = None
) -> dict[str, float]:
    """ARPO epochs (GRPO with train.replay.enabled=false); resumes from the last epoch checkpoint."""
    on_iteration = None
    if mlflow_run_id is not None:
        from flows import tracking

        c = tracking.client()
        per_epoch = iterations_per_epoch(p, selected_path)

        def on_iteration(epoch: int, it: int, metrics: dict[str, Any]) -> None:
            step = (epoch - 1) * per_epoch + it
            tracking.log_metrics(c, mlflow_run_id, {f"iter/{k}": v for k, v in metrics.items()}, step=step)

    return stages.train_stage(p, policy_dir, selected_path, out_dir, on_iteration=on_iteration)


@task(cache_policy=NO_CACHE, **ENV_RETRIES)
def evaluate_policies(
    p: Params, policies: dict[str, Path], out_dir: Path, metrics_path: Path
) -> dict[str, float]:
    """Greedy (and sampled) success of each named policy on both suites."""
    return stages.evaluate(p, policies, out_dir, metrics_path)
