"""MLflow tracking for the pipeline: one experiment per pipeline, one run per stage, same names.

Decisions:
- **Local store.** The store is local by default: sqlite at `<root>/mlflow.db`, artifacts under
  `<root>/mlruns` (MLflow 3 refuses the plain file store). `MLFLOW_TRACKING_URI` overrides it (e.g. a shared
  `mlflow server`); the artifact location is then the server's.
- **Explicit run ids.** All calls go through `MlflowClient` with an explicit run id, never the fluent
  `mlflow.start_run` stack: Prefect runs tasks in worker threads and the fluent active-run state is per
  thread, while an explicit id works from any thread (the train task logs per-iteration metrics from its
  thread).
- **Batched metrics.** Metrics are logged in batches (`log_batch`, at most 1000 per call, MLflow's limit),
  with a step for per-iteration and per-epoch series; params are a stage's params flattened to dotted keys.
- **Provenance tags.** Tags link the run to the code and data it came from: `mlflow.source.git.commit`
  (MLflow's own key, shown in the UI), `arpo.stage`, `arpo.key` (the stage's input hash, flows/spec.py),
  `arpo.pipeline_id` (shared by the stage runs of one pipeline run), `arpo.preset` / `arpo.overrides` (the
  ablation), and under DVC `dvc.exp_name` / `dvc.baseline_rev`.
- **Environment tags.** A commit does not fix what a run computes: the same commit's main job gave
  another behaviour-cloning loss before and after this machine's environment was rebuilt (docs/results.md,
  "The reader finished and versioned"). So every stage run also carries what it ran on: `arpo.env.python`,
  `arpo.env.torch`, `arpo.env.transformers` and `arpo.env.chromium` (the browser that draws MiniWoB's
  screens, taken from the system: requirements.lock pins the Python packages, not Debian's Chromium). A
  missing package or browser is left out, never an error.
- **No telemetry.** No telemetry: MLflow's usage telemetry is switched off by the environment set in
  flows/__init__.py.
- **One store per project.** One store per project, also for queued DVC experiments: `dvc exp run --queue` /
  `--run-all` run each experiment in a temporary copy of the workspace under `<project>/.dvc/tmp/exps/`, whose
  own `mlflow.db` would vanish with it. `store_root` maps such a directory back to the project, so every
  seed and arm of a study lands in the project's MLflow experiment (`arpo runs`, the MLflow UI).
- **Nested runs.** Runs nest: a pipeline run (`arpo run`, a deployment run) is a parent run named by its
  variant (`quick | train.replay.enabled=false`, tag `arpo.stage=pipeline`) and every stage run it executes
  is its child (`mlflow.parentRunId`), named by the stage. Stage runs carry their effective params
  (flows/spec.py, decision "Effective params") and are selected by the tag `arpo.stage`, not by name.
- **Experiment kind.** The experiment is a model-training experiment: tag
  `mlflow.experimentKind=custom_model_development` (the tag the MLflow 3 UI reads to choose its layout;
  without it an experiment with no runs opens on the GenAI overview).
- **Never left running.** A run never stays RUNNING (issue 34 items 1, 5, 6): it ends FINISHED, FAILED (an
  error) or KILLED (a Ctrl-C, a stop signal); a run whose process died without ending it (SIGKILL) is closed
  KILLED by the next run that takes the working tree's lock over from the dead holder (`close_runs_of`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag

from arpo_core.envs.miniwob.chromium import CHROMIUM_BINARY
from arpo_core.infra.lock import current_token

__all__ = [
    "close_runs_of",
    "comparison_table",
    "end_status",
    "ensure_experiment",
    "environment_tags",
    "finish_run",
    "git_commit",
    "log_artifacts",
    "log_metrics",
    "log_params",
    "run_rows",
    "start_run",
    "tracking_uri",
]

MAX_METRICS = 1000
MAX_PARAMS = 100
MAX_PARAM_CHARS = 6000
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""Decision "Experiment kind": the experiment tag MLflow 3's UI reads (values genai_development /
custom_model_development)."""
PIPELINE = "pipeline"
"""`arpo.stage` of a pipeline's parent run (decision "Nested runs")."""


def store_root(root: str | os.PathLike = ".") -> Path:
    """The project directory whose local store `root` uses: `root` itself, or, inside a DVC
    experiment's temporary workspace `<project>/.dvc/tmp/exps/...`, that project
    (decision "One store per project")."""
    path = Path(root).resolve()
    parts = path.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 4] == (".dvc", "tmp", "exps", parts[i + 3]) and i > 0:
            return Path(*parts[:i])
    return path


def tracking_uri(root: str | os.PathLike = ".") -> str:
    """`MLFLOW_TRACKING_URI` if set, else sqlite at `<project>/mlflow.db` (decisions "Local store" and
    "One store per project")."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{store_root(root) / 'mlflow.db'}"


def client(root: str | os.PathLike = ".") -> MlflowClient:
    uri = tracking_uri(root)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(c: MlflowClient, name: str, root: str | os.PathLike = ".") -> str:
    """Id of experiment `name`, created (artifacts under `<root>/mlruns` for a local store) if new."""
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND[0]) is None:
            # decision "Experiment kind", also for stores made before it
            c.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
        return exp.experiment_id
    location = None
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        location = (store_root(root) / "mlruns" / name).as_uri()
    return c.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))


def git_commit(root: str | os.PathLike = ".") -> str | None:
    """HEAD commit of the repository holding `root`, or None outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@functools.cache
def environment_tags() -> dict[str, str]:
    """What this process computes with (decision "Environment tags"), once per process."""
    from importlib.metadata import PackageNotFoundError, version

    tags = {"arpo.env.python": platform.python_version()}
    for pkg in ("torch", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            tags[f"arpo.env.{pkg}"] = version(pkg)
    try:
        out = subprocess.run(
            [CHROMIUM_BINARY, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
        if out.returncode == 0 and out.stdout.strip():
            tags["arpo.env.chromium"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return tags


def run_tags(stage: str, root: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Tags of a stage run (decision "Provenance tags"); None values are left out. `arpo.run_token` is the
    working tree's lock token of the run (arpo_core/infra/lock.py, decision "Takeover record"), how a later
    run finds what a dead one left RUNNING (mlflow_runs.py, decision "Never left running")."""
    tags: dict[str, Any] = {
        "arpo.stage": stage,
        "mlflow.source.git.commit": git_commit(root),
        "dvc.exp_name": os.environ.get("DVC_EXP_NAME"),
        "dvc.baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV"),
        "arpo.run_token": current_token(),
        **environment_tags(),
        **(extra or {}),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


def start_run(
    c: MlflowClient,
    experiment_id: str,
    name: str,
    tags: Mapping[str, str] | None = None,
    parent_run_id: str | None = None,
) -> str:
    """A new run named `name` (a stage, or a pipeline's variant), nested under `parent_run_id` if given
    (decision "Nested runs"); returns its id."""
    tags = dict(tags or {})
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    return c.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def log_params(c: MlflowClient, run_id: str, params: Mapping[str, Any]) -> None:
    """Log flat params (values stringified; None as 'null', as YAML writes it)."""
    items = [Param(k, ("null" if v is None else str(v))[:MAX_PARAM_CHARS]) for k, v in sorted(params.items())]
    for chunk in _chunks(items, MAX_PARAMS):
        c.log_batch(run_id, params=chunk)


def log_metrics(
    c: MlflowClient, run_id: str, metrics: Mapping[str, Any], step: int = 0, model_id: str | None = None
) -> int:
    """Log the numeric entries of `metrics` at `step` in batches (decision "Batched metrics"), linked to
    logged model `model_id` if given; returns how many."""
    now = int(time.time() * 1000)
    items = [
        Metric(k, float(v), now, step, model_id=model_id)
        for k, v in sorted(metrics.items())
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    for chunk in _chunks(items, MAX_METRICS):
        c.log_batch(run_id, metrics=chunk)
    return len(items)


def log_artifacts(c: MlflowClient, run_id: str, path: str | os.PathLike, artifact_path: str) -> None:
    """A file or a directory as artifacts under `artifact_path`; a missing path is skipped."""
    path = Path(path)
    if path.is_dir():
        c.log_artifacts(run_id, str(path), artifact_path)
    elif path.is_file():
        c.log_artifact(run_id, str(path), artifact_path)


def end_status(error: BaseException | None) -> str:
    """The MLflow status a run ends with (decision "Never left running"): FINISHED without an error, FAILED
    for an error (an `Exception`), KILLED when it was interrupted or told to stop (the other BaseExceptions:
    KeyboardInterrupt, SystemExit from a signal handler, Prefect's TerminationSignal for SIGTERM)."""
    if error is None:
        return RunStatus.to_string(RunStatus.FINISHED)
    if isinstance(error, Exception):
        return RunStatus.to_string(RunStatus.FAILED)
    return RunStatus.to_string(RunStatus.KILLED)


def finish_run(c: MlflowClient, run_id: str, ok: bool | str) -> None:
    """End the run FINISHED (`ok` True) or FAILED (False), or with the status `ok` names (`end_status`)."""
    status = (
        ok if isinstance(ok, str) else RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
    )
    c.set_terminated(run_id, status)


def close_runs_of(c: MlflowClient, token: str, reason: str) -> list[dict[str, str]]:
    """Decision "Never left running": end KILLED every RUNNING run (any experiment of the store) whose
    `arpo.run_token` is `token`, the lock token of a run that died, with tag `arpo.ended` = `reason`. Returns
    {"run", "stage", "pipeline_id"} of each run closed."""
    if not token.isalnum():  # a lock token is hex; anything else never reaches a filter string
        return []
    experiments = [e.experiment_id for e in c.search_experiments()]
    if not experiments:
        return []
    flt = f"tags.`arpo.run_token` = '{token}' and attributes.status = 'RUNNING'"
    closed = []
    for run in c.search_runs(experiments, filter_string=flt, max_results=1000):
        rid = run.info.run_id
        set_tags(c, rid, {"arpo.ended": reason})
        c.set_terminated(rid, RunStatus.to_string(RunStatus.KILLED))
        tags = run.data.tags
        closed.append(
            {"run": rid, "stage": tags.get("arpo.stage", ""), "pipeline_id": tags.get("arpo.pipeline_id", "")}
        )
    return closed


def set_tags(c: MlflowClient, run_id: str, tags: Mapping[str, str]) -> None:
    c.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


# ------------------------------------------------------------------------------------------------
# Comparison table (`arpo runs`)

DEFAULT_COLUMNS = (
    "_success_rate",
    "_delta_vs_base",
    "_rollout_success_rate",
    "rollout/success_rate",
    "replay/groups_filled",
    "loss/policy",
    "eval/base/greedy/in_domain/success_rate",
    "eval/trained/greedy/in_domain/success_rate",
    "eval/trained/greedy/out_of_domain/success_rate",
)
MAX_PARAM_COLUMNS = 4


def default_columns(rows: Sequence[Mapping[str, Any]], n: int = 6) -> list[str]:
    """DEFAULT_COLUMNS present in `rows`, else the first `n` metric keys the rows have (sorted)."""
    cols = [c for c in DEFAULT_COLUMNS if any(c in r for r in rows)]
    if cols:
        return cols
    keys = sorted({k for r in rows for k in r if "/" in k and not k.startswith(("time/", "iter/"))})
    return keys[:n]


def differing_params(rows: Sequence[Mapping[str, Any]], limit: int = MAX_PARAM_COLUMNS) -> list[str]:
    """The params whose values differ between runs of the same stage among `rows` (each row's
    'params' dict): what the variants changed, as MLflow's compare view shows it. At most `limit`,
    sorted; a param a run lacks counts as different."""
    by_stage: dict[str, list[Mapping[str, str]]] = {}
    for r in rows:
        by_stage.setdefault(str(r.get("stage", "")), []).append(r.get("params") or {})
    keys: set[str] = set()
    for runs in by_stage.values():
        if len(runs) > 1:
            for k in set().union(*runs):
                if len({run.get(k) for run in runs}) > 1:
                    keys.add(k)
    return sorted(keys)[:limit]


def comparison_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], params: Sequence[str] = ()
) -> str:
    """Plain-text table of runs: `rows` are dicts with 'run', 'name' (else 'stage'), 'variant', 'status',
    'minutes', metric values and a 'params' dict; `columns` are the metric keys shown (headers shortened by
    `short_name`), `params` the param keys shown before them (e.g. `differing_params`).
    Missing values print as '-'; numbers with 3 significant digits."""
    head = ["run", "name", "variant", "status", "min", *params, *[short_name(c) for c in columns]]
    body = []
    for r in rows:
        ps = r.get("params") or {}
        cells = [
            str(r.get("run", ""))[:8],
            str(
                r.get("name") or r.get("stage", "")
            ),  # the run's name: `evaluate · grpo` (runner.py, decision "Headline metric first")
            str(r.get("variant", "")),
            str(r.get("status", "")),
            _fmt(r.get("minutes")),
            *[str(ps.get(k, "-")) for k in params],
            *[_fmt(r.get(c)) for c in columns],
        ]
        body.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        "  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def short_name(key: str) -> str:
    """Column header of a metric: 'eval/trained/greedy/in_domain/success_rate' ->
    'trained/in_domain/success'."""
    out = key.removeprefix("eval/").replace("/greedy/", "/").replace("success_rate", "success")
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def run_rows(c: MlflowClient, experiment: str, stage: str | None = None) -> list[dict[str, Any]]:
    """One dict per run of `experiment` (newest first), optionally only the runs of `stage` (tag
    `arpo.stage`; `pipeline` selects the parent runs)."""
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    flt = f"tags.`arpo.stage` = '{stage}'" if stage else ""
    runs = c.search_runs([exp.experiment_id], filter_string=flt, order_by=["attributes.start_time DESC"])
    rows = []
    for run in runs:
        info, data = run.info, run.data
        minutes = (info.end_time - info.start_time) / 60000 if info.end_time and info.start_time else None
        rows.append(
            {
                "run": info.run_id,
                "name": info.run_name,
                "stage": data.tags.get("arpo.stage", info.run_name),
                "variant": data.tags.get("arpo.variant", ""),
                "status": info.status,
                "minutes": minutes,
                "params": dict(data.params),
                "parent": data.tags.get("mlflow.parentRunId"),
                **data.metrics,
            }
        )
    return rows
