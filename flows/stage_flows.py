"""One Prefect flow per pipeline stage, built from the stage table (DVC stage `NAME` = flow `NAME` =
params section `NAME` = MLflow run `NAME`).

Decisions:
- **Generated flows.** The flows are generated, not written one file each: every stage flow has the same body
  (a `StageRun`, flows/runner.py) and the same parameters (the strings `arpo run` and `dvc exp run -S`
  take), so one factory over `arpo_core/pipeline/table.py` is the whole definition and a new stage
  needs a table row, not another module.
- **String parameters.** Parameters are strings (params file, preset name, dotted overrides), so a flow run is
  reproducible from its parameters alone; `pipeline_id` links the stage runs of one pipeline run in MLflow and
  `parent_run_id` nests them under the pipeline's MLflow run.
- **Named flow runs.** Flow runs are named by stage and variant (`train | quick |
  train.replay.enabled=false`), not Prefect's random adjective-animal names, so the UI's run list says what
  each run was.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import Flow, flow

from arpo_core.pipeline.table import STAGES, Stage
from flows.runner import StageRun, variant_name

__all__ = ["FLOWS"]


def _stage_flow(s: Stage) -> Flow:
    def run_stage_flow(
        params: str = "params.yaml",
        preset: str | None = None,
        overrides: list[str] | None = None,
        pipeline_id: str | None = None,
        parent_run_id: str | None = None,
    ) -> dict[str, float]:
        return StageRun(s.name, params, preset, overrides, pipeline_id, parent_run_id=parent_run_id).execute()

    run_stage_flow.__doc__ = f"Stage `{s.name}`: {s.module}.run, tracked in MLflow."
    return flow(run_stage_flow, name=s.name, log_prints=True, flow_run_name=run_name(s.name))


def run_name(prefix: str | None = None) -> Callable[[], str]:
    """Decision "Named flow runs": a flow run's name from its parameters, '<prefix> | <variant>' (or the
    variant)."""

    def name() -> str:
        from prefect.runtime import flow_run

        ps = flow_run.parameters or {}
        variant = variant_name(ps.get("preset"), ps.get("overrides"))
        return f"{prefix} | {variant}" if prefix else variant

    return name


FLOWS: dict[str, Flow] = {s.name: _stage_flow(s) for s in STAGES}
"""Stage name -> its Prefect flow, in pipeline order."""
