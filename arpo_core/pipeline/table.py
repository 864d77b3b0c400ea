"""The stage table: every pipeline stage, in pipeline order.

Each row is the `STAGE` object its module under `arpo_core/pipeline/` exports (stage.py: what a stage
is), imported directly, so the table, `dvc.yaml` (generated from it by `arpo dvc-yaml`), the Prefect
flows and tasks and the runner all read the same objects and none looks a module up by name. The one
walk of the stage graph is `upstream` (what `dvc repro TARGET` runs; `arpo run` and the runner use it too).
"""

from __future__ import annotations

from collections.abc import Iterable

from arpo_core.pipeline import (
    baseline,
    compare,
    demos,
    evaluate,
    ground,
    init_policy,
    offline_baselines,
    select,
    sft,
    train,
)
from arpo_core.pipeline.stage import ROOT, Stage, code_deps, import_closure

__all__ = [
    "BY_NAME",
    "ROOT",
    "STAGES",
    "STAGE_NAMES",
    "Stage",
    "code_deps",
    "import_closure",
    "stage",
    "upstream",
]

STAGES: tuple[Stage, ...] = (
    init_policy.STAGE,
    ground.STAGE,
    demos.STAGE,
    sft.STAGE,
    baseline.STAGE,
    select.STAGE,
    train.STAGE,
    *offline_baselines.STAGES,
    evaluate.STAGE,
    compare.STAGE,
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
"""Stage name -> its object: the one lookup every front door uses (`stage(name)`, flows/spec.py `SPECS`)."""


def stage(name: str) -> Stage:
    """The row of stage `name`; an unknown name is an error listing the stages."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}") from None


def upstream(targets: Iterable[str]) -> tuple[str, ...]:
    """The stages `targets` need, themselves included, in pipeline order: every stage that writes one of
    their inputs, recursively (what `dvc repro TARGET` runs). An unknown name is an error."""
    producer = {out: s.name for s in STAGES for out in s.outs}
    need: set[str] = set()
    todo = [stage(t).name for t in targets]
    while todo:
        name = todo.pop()
        if name in need:
            continue
        need.add(name)
        todo += [producer[path] for path in stage(name).input_paths if path in producer]
    return tuple(n for n in STAGE_NAMES if n in need)
