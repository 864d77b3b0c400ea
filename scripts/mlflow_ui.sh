#!/usr/bin/env bash
# The MLflow UI on this project's store: http://127.0.0.1:${MLFLOW_PORT:-5000}, one worker (the
# default four take ~1.7 GB), sqlite store ./mlflow.db with artifacts in ./mlruns (tracking/mlflow_runs.py).
# No job runner: MLflow 3 starts huey consumer processes for its GenAI jobs (trace rollups, scorers),
# which a training project never submits.
set -euo pipefail
cd "$(dirname "$0")/.."
export MLFLOW_DISABLE_TELEMETRY=true
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
exec .venv/bin/mlflow ui --host 127.0.0.1 --port "${MLFLOW_PORT:-5000}" --workers 1 \
  --backend-store-uri "${MLFLOW_TRACKING_URI:-sqlite:///$PWD/mlflow.db}" \
  --default-artifact-root "$PWD/mlruns" "$@"
