"""Stage `select`: valuable task selection from the baseline rollouts (>= 1 success, feasible only)."""

from __future__ import annotations

import os
from typing import Any

from arpo_core.config import Params
from arpo_core.pipeline.common import suite_tasks
from arpo_core.selection import select_tasks, write_selection
from arpo_core.trajectory import read_trajectories

__all__ = ["run"]


def run(p: Params, baseline_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """The kept tasks to `out_path` (JSON)."""
    infeasible = {t.key for t in suite_tasks(p, "in_domain") if not t.feasible}
    sel = select_tasks(read_trajectories(baseline_dir), p.select, infeasible=infeasible)
    write_selection(out_path, sel)
    return {"select/kept": float(len(sel.kept)), "select/tasks": float(len(sel.counts))}
