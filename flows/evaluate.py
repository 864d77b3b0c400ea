"""The `evaluate` stage as a Prefect flow (DVC stage `evaluate`, params section `evaluate`, MLflow run `evaluate`)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.runner import StageRun, call
from tasks.stages import evaluate_policies


@flow(name="evaluate", log_prints=True)
def evaluate(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    pipeline_id: str | None = None,
) -> dict[str, float]:
    """Base vs trained policy, in-domain and out-of-domain: data/eval, metrics/evaluate.json."""
    return StageRun("evaluate", params, preset, overrides, pipeline_id).execute(
        lambda s: call(
            evaluate_policies,
            s.p,
            {"base": s.path("sft"), "arpo": s.path("train") / "policy"},
            s.path("evaluate"),
            Path("metrics/evaluate.json"),
        )
    )
