"""One Prefect flow per pipeline stage, built from the stage table (DVC stage `NAME` = flow `NAME` =
params section `NAME` = MLflow run `NAME`).

Decisions:
1. The flows are generated, not written one file each: every stage flow has the same body (a
   `StageRun`, flows/runner.py) and the same parameters (the strings `arpo run` and `dvc exp run -S`
   take), so one factory over `arpo_core/pipeline/table.py` is the whole definition and a new stage
   needs a table row, not another module.
2. Parameters are strings (params file, preset name, dotted overrides), so a flow run is reproducible from
   its parameters alone; `pipeline_id` links the stage runs of one pipeline run in MLflow.
"""

from __future__ import annotations

from prefect import Flow, flow

from arpo_core.pipeline.table import STAGES, Stage
from flows.runner import StageRun

__all__ = ["FLOWS"]


def _stage_flow(s: Stage) -> Flow:
    def run_stage_flow(
        params: str = "params.yaml",
        preset: str | None = None,
        overrides: list[str] | None = None,
        pipeline_id: str | None = None,
    ) -> dict[str, float]:
        return StageRun(s.name, params, preset, overrides, pipeline_id).execute()

    run_stage_flow.__doc__ = f"Stage `{s.name}`: arpo_core.pipeline.{s.module}.run, tracked in MLflow."
    return flow(run_stage_flow, name=s.name, log_prints=True)


FLOWS: dict[str, Flow] = {s.name: _stage_flow(s) for s in STAGES}
"""Stage name -> its Prefect flow, in pipeline order."""
