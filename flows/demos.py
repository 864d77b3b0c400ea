"""The `demos` stage as a Prefect flow (DVC stage `demos`, params section `demos`, MLflow run `demos`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import play_demos


@flow(name="demos", log_prints=True)
def demos(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Scripted oracles play the in-domain MiniWoB suite: data/demos/demos.parquet."""
    return StageRun("demos", params, preset, overrides, pipeline_id).execute(
        lambda s: call(play_demos, s.p, s.path("demos"))
    )
