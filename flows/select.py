"""The `select` stage as a Prefect flow (DVC stage `select`, params section `select`, MLflow run `select`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import select_tasks


@flow(name="select", log_prints=True)
def select(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Valuable task selection from the baseline rollouts: data/selected_tasks.json."""
    return StageRun("select", params, preset, overrides, pipeline_id).execute(
        lambda s: call(select_tasks, s.p, s.path("baseline"), s.path("select"))
    )
