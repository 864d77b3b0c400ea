"""The `baseline` stage as a Prefect flow (DVC stage `baseline`, params section `baseline`, MLflow run `baseline`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import roll_out_baseline


@flow(name="baseline", log_prints=True)
def baseline(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Rollouts of the base policy on the in-domain suite: data/baseline/in_domain.parquet."""
    return StageRun("baseline", params, preset, overrides, pipeline_id).execute(
        lambda s: call(roll_out_baseline, s.p, s.path("sft"), s.path("baseline"))
    )
