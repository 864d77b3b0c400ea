"""The `sft` stage as a Prefect flow (DVC stage `sft`, params section `sft`, MLflow run `sft`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import clone_behaviour


@flow(name="sft", log_prints=True)
def sft(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Behaviour cloning of the grounded policy on the demos -> the base policy: models/base."""
    return StageRun("sft", params, preset, overrides, pipeline_id).execute(
        lambda s: call(clone_behaviour, s.p, s.path("ground"), s.path("demos"), s.path("sft"))
    )
