"""The pipeline's policies as MLflow models (the "Logged models" of a run), loadable with
`mlflow.pyfunc.load_model("models:/<model_id>")`.

Decisions:
- **Pyfunc wrapper.** Flavour pyfunc with a `PythonModel` around the project's own loader: the policy is a
  Qwen2.5-VL checkpoint directory (tokenizer, image processor, weights) that
  `arpo_core.policy.model.load_policy` loads, and what a user wants back from MLflow is "give it a screenshot
  and an instruction, get the UI-TARS reply", which pyfunc's `predict` expresses directly. The checkpoint
  directory is the model's artifact `policy` (copied into the model, not referenced), the prompt settings its
  `model_config`.
- **Logged by run id.** Logged with the run's id (`Model.log(run_id=...)`), not through the fluent active-run
  stack (mlflow_runs.py, decision "Explicit run ids"); MLflow then links the run's metrics at `step` to the
  model. The logged model itself is created first, in the run's experiment, with the run's params: without an
  active run MLflow would file it under the fluent default experiment ("Default"), away from the run's
  "Logged models".
- **Pinned requirements.** Requirements are pinned from the installed versions instead of inferred: inference
  loads the model in a subprocess (tens of seconds per model here) to guess what we already know.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel
from mlflow.types import ColSpec, Schema

from arpo_core.policy.prompt import PromptSpec

__all__ = ["PolicyModel", "log_policy_model"]

SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "instruction"), ColSpec("binary", "screenshot")]),
    outputs=Schema([ColSpec("string")]),
)
REQUIREMENTS = ("torch", "transformers", "pillow", "pandas", "mlflow")


warnings.filterwarnings("ignore", message="Add type hints to the `predict` method", category=UserWarning)
warnings.filterwarnings("ignore", message="An input example was not provided", category=UserWarning)


class PolicyModel(PythonModel):
    """Input: a DataFrame with `instruction` (str) and `screenshot` (PNG bytes) columns, one row per
    prompt; output: the greedy replies, one string per row."""

    def load_context(self, context):  # no hints: MLflow validates predict input by them
        from arpo_core.pipeline.policies import resolve_policy
        from arpo_core.policy.model import load_policy

        self.config = dict(context.model_config or {})
        self.policy = load_policy(resolve_policy(context.artifacts["policy"]))

    def predict(self, context, model_input, params=None):
        from PIL import Image

        from arpo_core.policy.generate import HFGenerator
        from arpo_core.policy.prompt import PromptInput

        cfg = {**self.config, **(params or {})}
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else list(model_input)
        batch = [
            PromptInput(
                instruction=str(r["instruction"]),
                screenshots=(Image.open(io.BytesIO(r["screenshot"])).convert("RGB"),),
            )
            for r in rows
        ]
        gen = HFGenerator(
            self.policy, spec=PromptSpec(cfg.get("system_prompt", "compact"), cfg.get("history_images"))
        )
        out = gen.generate(
            batch, temperature=0.0, top_p=1.0, max_new_tokens=int(cfg.get("max_new_tokens", 64))
        )
        return [g.text for g in out]


def _requirements() -> list[str]:
    reqs = []
    for name in REQUIREMENTS:
        try:
            reqs.append(f"{name}=={metadata.version(name).split('+')[0]}")
        except metadata.PackageNotFoundError:
            reqs.append(name)
    return reqs


def log_policy_model(
    tracking_uri: str,
    run_id: str,
    policy_dir: str | os.PathLike,
    name: str,
    config: dict[str, Any],
    step: int = 0,
) -> str:
    """Log the checkpoint at `policy_dir` as run `run_id`'s model `name` (decisions "Pyfunc wrapper",
    "Logged by run id" and "Pinned requirements"); returns its model id. The run's metrics at `step` are
    linked to it, so log them first."""
    with _tracking_uri(tracking_uri):
        c = mlflow.MlflowClient(tracking_uri)
        run = c.get_run(run_id)
        model = c.create_logged_model(
            experiment_id=run.info.experiment_id,
            name=name,
            source_run_id=run_id,
            params=dict(run.data.params),
            model_type="policy",
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "consider an input example" advice, per model
            info = mlflow.models.Model.log(
                artifact_path=None,
                name=name,
                flavor=mlflow.pyfunc,
                run_id=run_id,
                python_model=PolicyModel(),
                artifacts={"policy": str(Path(policy_dir).resolve())},
                model_config=dict(config),
                pip_requirements=_requirements(),
                signature=SIGNATURE,
                step=step,
                model_id=model.model_id,
            )
        return info.model_id


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's global tracking URI set to `uri` for the block (Model.log resolves the run's artifact
    store through it), then put back, environment included: `mlflow.set_tracking_uri` also exports
    MLFLOW_TRACKING_URI, which then sent every later client of the process (and its children) to this
    store - test stores included."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    before = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before
