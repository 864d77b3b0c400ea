"""The `ground` stage as a Prefect flow (DVC stage `ground`, params section `ground`, MLflow run `ground`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import ground_policy


@flow(name="ground", log_prints=True)
def ground(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Grounding pretraining (or the versioned grounded checkpoint), measured on held-out screens:
    models/grounded."""
    return StageRun("ground", params, preset, overrides, pipeline_id).execute(
        lambda s: call(ground_policy, s.p, s.path("init_policy"), s.path("ground"))
    )
