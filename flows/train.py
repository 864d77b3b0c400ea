"""The `train` stage as a Prefect flow (DVC stage `train`, params section `train`, MLflow run `train`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import train_policy


@flow(name="train", log_prints=True)
def train(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """ARPO epochs from the base policy on the selected tasks: models/arpo (policy, checkpoints, trajectories)."""
    return StageRun("train", params, preset, overrides, pipeline_id).execute(
        lambda s: call(train_policy, s.p, s.path("sft"), s.path("select"), s.path("train"), s.run_id)
    )
