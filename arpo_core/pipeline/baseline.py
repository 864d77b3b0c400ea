"""Stage `baseline`: N sampled rollouts per in-domain task of the base policy (task selection's input,
and the data of the offline baselines rft / dpo / kto); with a suite of pinned instances, N rollouts of
each instance (the paper's 16 per task)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from arpo_core.algorithm.rollout import EpisodeJob, run_episodes
from arpo_core.config import Params
from arpo_core.pipeline.common import progress_bar, suite_tasks
from arpo_core.pipeline.policies import resolve_policy, setup_torch
from arpo_core.pipeline.rollouts import generator, make_pool, pool_faults, rollout_config
from arpo_core.pipeline.stage import ROLLOUT, SUITES, TASK_DATA, Stage
from arpo_core.trajectory import write_trajectories

__all__ = ["STAGE", "baseline_jobs", "run"]


def baseline_jobs(p: Params) -> list[EpisodeJob]:
    """`baseline.episodes_per_task` rollouts of every in-domain task: of a family on env seeds
    `baseline.seed + k`, of a pinned instance on itself (the paper's selection: N rollouts per instance)."""
    b = p.baseline
    return [
        EpisodeJob(t, seed=b.seed + k, group_id=g, sample_idx=k)
        for g, t in enumerate(suite_tasks(p, "in_domain"))
        for k in range(b.episodes_per_task)
    ]


def run(p: Params, policy_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Rollouts of the base policy to `out_dir/in_domain.parquet`; metrics `baseline/...`."""
    from arpo_core.policy.model import load_policy

    setup_torch(p)
    policy_dir = resolve_policy(policy_dir)
    b = p.baseline
    gen = generator(p, load_policy(policy_dir), policy_dir)
    jobs = baseline_jobs(p)
    cfg = rollout_config(p, policy_dir, b.temperature, b.top_p, b.max_steps, p.project.seed)
    with make_pool(p) as pool:
        bar = progress_bar(len(jobs), "baseline")
        res = run_episodes(pool, gen, jobs, cfg, run_id="baseline", stage="baseline", progress=bar)
        bar.close()
    write_trajectories(Path(out_dir) / "in_domain.parquet", res.trajectories)
    metrics = {k.replace("rollout/", "baseline/"): v for k, v in res.metrics.items()}
    # the close's too (rollouts.py, decision "Pool-life faults")
    return metrics | pool_faults(pool, "baseline/faults")


STAGE = Stage(
    "baseline",
    run=run,
    params=("baseline", *ROLLOUT, *SUITES),
    inputs={"policy_dir": "models/base"},
    outputs={"out_dir": "data/baseline"},
    artifacts={"data/baseline": "trajectories"},
    data=TASK_DATA,
    envs=True,
)
