"""Stage `select`: valuable task selection from the baseline rollouts (>= 1 success, feasible only)."""

from __future__ import annotations

import os
from typing import Any

from arpo_core.algorithm.selection import Selection, select_tasks, write_selection
from arpo_core.config import Params
from arpo_core.pipeline.common import suite_tasks
from arpo_core.pipeline.stage import TASK_DATA, Stage
from arpo_core.trajectory import read_trajectories

__all__ = ["STAGE", "kept_distribution", "run"]


def run(p: Params, baseline_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """The kept tasks to `out_path` (JSON)."""
    infeasible = {t.key for t in suite_tasks(p, "in_domain") if not t.feasible}
    sel = select_tasks(
        read_trajectories(baseline_dir),
        p.select,
        infeasible=infeasible,
        success_threshold=p.project.success_threshold,
    )
    write_selection(out_path, sel)
    return {"select/kept": float(len(sel.kept)), "select/tasks": float(len(sel.counts))} | kept_distribution(
        sel
    )


def kept_distribution(sel: Selection) -> dict[str, float]:
    """The kept tasks' sampled base success: mean, quartiles, the share at or below 25% (where all-fail
    groups are common), and how many were kept with each success count (`select/kept_with/<k>`)."""
    rates = sorted(sel.counts[k].rate for k in sel.kept)
    if not rates:
        return {}

    def q(f: float) -> float:  # nearest-rank quantile of the sorted rates
        return rates[min(len(rates) - 1, int(f * len(rates)))]

    out = {
        "select/kept_rate_mean": sum(rates) / len(rates),
        "select/kept_rate_p25": q(0.25),
        "select/kept_rate_p50": q(0.5),
        "select/kept_rate_p75": q(0.75),
        "select/kept_rare_frac": sum(r <= 0.25 for r in rates) / len(rates),
    }
    for k in sel.kept:
        name = f"select/kept_with/{sel.counts[k].successes:02d}"
        out[name] = out.get(name, 0.0) + 1.0
    for reason, n in sel.reasons().items():
        out[f"select/reason/{reason}"] = float(n)
    return out


STAGE = Stage(
    "select",
    run=run,
    params=(
        "select",
        "project.success_threshold",
        "env.kind",
        "env.in_domain_suite",
        "env.out_of_domain_suite",
    ),
    inputs={"baseline_dir": "data/baseline"},
    outputs={"out_path": "data/selected_tasks.json"},
    artifacts={"data/selected_tasks.json": "selection"},
    data=TASK_DATA,
)
