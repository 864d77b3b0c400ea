"""Prefect flows (one per pipeline stage, plus `arpo-train`) and the `arpo` CLI; MLflow lives in tracking/.

Importing this package sets local, private defaults before Prefect or MLflow are imported (each only
when the variable is not already set): Prefect's home inside the project (`.prefect/`, so its sqlite
database and settings stay with the project), no Prefect, MLflow or DVC usage analytics, and 120 s
(Prefect's default: 20 s) for a temporary Prefect server to start: on a loaded 2-core machine its start
took longer than 20 s and the run failed before its first stage ("Timed out while attempting to connect
to ephemeral Prefect API server", seen in a CI run of session 8).
"""

import os
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", str(Path.cwd() / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
