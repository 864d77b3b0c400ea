"""The `init_policy` stage as a Prefect flow (DVC stage `init_policy`, params section `init_policy`, MLflow run `init_policy`)."""

from __future__ import annotations

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import build_policy


@flow(name="init_policy", log_prints=True)
def init_policy(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Build the tiny offline Qwen2.5-VL policy (or point at a pretrained one): models/init."""
    return StageRun("init_policy", params, preset, overrides, pipeline_id).execute(
        lambda s: call(build_policy, s.p, s.path("init_policy"))
    )
