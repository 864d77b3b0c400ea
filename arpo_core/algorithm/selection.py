"""Valuable task selection: keep the tasks the base agent can sometimes solve (docs/method.md §1).

ARPO runs the base agent N = 16 times per task before training and trains only on tasks with at least
one success, infeasible tasks excluded (128 of OSWorld's 369); single-node runs used a 32-task subset.
A task the base agent never solves gives all-failed GRPO groups and nothing for the replay buffer to
store, so it costs rollouts and teaches nothing.

Decisions:
- **Success threshold.** A rollout counts as a success when its checker score is strictly greater than
  `success_threshold` (default 0.1, the replay buffer's threshold), so "selected" means exactly "the replay
  buffer would have had something to store for it". OSWorld's fractional scores in (0, 0.1] are not successes.
- **Ordered drop rules.** Rules, applied in this order, each naming the reason a task is dropped: `excluded`
  (keys passed by the caller), `infeasible` (keys passed by the caller: `Trajectory` has no feasibility field,
  and the suite file, not the rollouts, knows which tasks are infeasible), `too_few_successes`
  (< `min_successes`, default 1), `always_solved` (only when `max_success_rate` is set: a task solved
  in every rollout gives all-success groups with zero advantage too; off by default, as in the paper),
  then `over_cap`.
- **Task cap.** Cap: the paper does not say how its 32-task subset was drawn. `cap_mode="random"` (default)
  draws a seeded uniform sample of the eligible tasks, which keeps the suite's difficulty mix;
  `cap_mode="top"` keeps the highest success counts (ties by key), i.e. the easiest tasks.
- **Deterministic selection.** Deterministic: tasks are sorted by key before any sampling and the sample uses
  its own `random.Random(seed)`, so the same baseline and parameters give the same selection anywhere.
- **Recorded selection.** The result records every task seen with n, successes, rate and its reason, and the
  parameters used; `write_selection` writes it as JSON atomically (temp file + fsync + rename).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from arpo_core.config.sections import SelectConfig
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.trajectory import Trajectory

__all__ = [
    "Outcome",
    "SelectConfig",
    "Selection",
    "TaskCount",
    "count_outcomes",
    "read_selection",
    "select_tasks",
    "write_selection",
]

Key = tuple[str, str]
_FORMAT_VERSION = 1

KEPT = "kept"
EXCLUDED = "excluded"
INFEASIBLE = "infeasible"
TOO_FEW = "too_few_successes"
ALWAYS_SOLVED = "always_solved"
OVER_CAP = "over_cap"


class Outcome(NamedTuple):
    """One baseline rollout reduced to what selection needs."""

    task_domain: str
    task_id: str
    success: float
    """The checker's score in [0, 1]."""


class TaskCount(NamedTuple):
    """Baseline statistics of one task and the selection verdict."""

    n: int
    """Rollouts seen."""
    successes: int
    """Rollouts with success > success_threshold."""
    rate: float
    """successes / n."""
    reason: str
    """'kept' or why the task was dropped."""


@dataclass(frozen=True)
class Selection:
    """The selected tasks, the statistics of every task seen, and the parameters used."""

    kept: tuple[Key, ...]
    """Selected keys, sorted."""
    counts: dict[Key, TaskCount]
    """Every task seen in the baseline (and every infeasible/excluded key), with its verdict."""
    params: SelectConfig

    def reasons(self) -> dict[str, int]:
        """How many tasks each verdict covers, e.g. {'kept': 30, 'too_few_successes': 12}."""
        out: dict[str, int] = {}
        for c in self.counts.values():
            out[c.reason] = out.get(c.reason, 0) + 1
        return out


def _as_outcome(r: Trajectory | Outcome | tuple) -> Outcome:
    if isinstance(r, Trajectory):
        return Outcome(r.task_domain, r.task_id, float(r.success))
    domain, task_id, success = r
    return Outcome(str(domain), str(task_id), float(success))


def count_outcomes(
    records: Iterable[Trajectory | Outcome | tuple[str, str, float]], success_threshold: float
) -> dict[Key, tuple[int, int]]:
    """Per key: (rollouts, successes), a success being success > success_threshold.

    Records are Trajectory objects (their `success`, not the trained reward) or (domain, id, success).
    """
    out: dict[Key, tuple[int, int]] = {}
    for r in records:
        o = _as_outcome(r)
        n, s = out.get((o.task_domain, o.task_id), (0, 0))
        out[(o.task_domain, o.task_id)] = (n + 1, s + (o.success > success_threshold))
    return out


def select_tasks(
    records: Iterable[Trajectory | Outcome | tuple[str, str, float]],
    params: SelectConfig | None = None,
    infeasible: Collection[Key] = (),
    exclude: Collection[Key] = (),
    *,
    success_threshold: float,
) -> Selection:
    """Select the valuable tasks from baseline rollouts (N per task); see the module decisions. A success
    is a score strictly above `success_threshold` (params `project.success_threshold`)."""
    params = params or SelectConfig()
    infeasible = {tuple(k) for k in infeasible}
    exclude = {tuple(k) for k in exclude}
    counts = count_outcomes(records, success_threshold)
    # Keys only named as infeasible/excluded still get a verdict, so the report lists them.
    for k in infeasible | exclude:
        counts.setdefault(k, (0, 0))

    verdict: dict[Key, str] = {}
    eligible: list[Key] = []
    for k in sorted(counts):
        n, s = counts[k]
        if k in exclude:
            verdict[k] = EXCLUDED
        elif k in infeasible:
            verdict[k] = INFEASIBLE
        elif s < params.min_successes or n == 0:
            verdict[k] = TOO_FEW
        elif params.max_success_rate is not None and s / n > params.max_success_rate:
            verdict[k] = ALWAYS_SOLVED
        else:
            verdict[k] = KEPT
            eligible.append(k)

    if params.max_tasks is not None and len(eligible) > params.max_tasks:
        if params.cap_mode == "top":
            chosen = sorted(eligible, key=lambda k: (-counts[k][1], k))[: params.max_tasks]
        else:
            chosen = random.Random(params.seed).sample(eligible, params.max_tasks)
        chosen_set = set(chosen)
        for k in eligible:
            if k not in chosen_set:
                verdict[k] = OVER_CAP
        eligible = sorted(chosen_set)

    table = {
        k: TaskCount(n=n, successes=s, rate=s / n if n else 0.0, reason=verdict[k])
        for k, (n, s) in sorted(counts.items())
    }
    return Selection(kept=tuple(eligible), counts=table, params=params)


def write_selection(path: str | os.PathLike, selection: Selection) -> Path:
    """Write the selection as JSON, atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format_version": _FORMAT_VERSION,
        "params": asdict(selection.params),
        "kept": [{"task_domain": d, "task_id": i} for d, i in selection.kept],
        "summary": selection.reasons(),
        "tasks": [
            {"task_domain": d, "task_id": i, **c._asdict()} for (d, i), c in sorted(selection.counts.items())
        ],
    }
    atomic_write_json(path, doc, indent=1)
    return path


def read_selection(path: str | os.PathLike) -> Selection:
    """Read a file written by `write_selection`."""
    path = Path(path)
    doc = json.loads(path.read_text(encoding="utf-8"))
    if doc.get("format_version") != _FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format_version {doc.get('format_version')!r}")
    counts = {
        (t["task_domain"], t["task_id"]): TaskCount(
            n=int(t["n"]), successes=int(t["successes"]), rate=float(t["rate"]), reason=str(t["reason"])
        )
        for t in doc["tasks"]
    }
    kept = tuple((k["task_domain"], k["task_id"]) for k in doc["kept"])
    return Selection(kept=kept, counts=counts, params=SelectConfig(**doc["params"]))
