"""MLflow: the pipeline's runs (`mlflow_runs`: one experiment, a run per stage, nested under a pipeline
run), its policies as MLflow models (`policy_model`) and the multi-seed studies read back from the
runs (`study_runs`). The library (arpo_core) never imports this package; flows/ and the CLI do.

Importing it switches MLflow's usage telemetry and artifact progress bars off, unless already set."""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
