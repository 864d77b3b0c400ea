"""Running one stage with tracking: the part every stage flow shares, also used by `arpo stage` (DVC).

Decisions:
1. One code path for the three front doors. A stage flow (Prefect), `arpo stage NAME` (what each DVC
   stage's `cmd` runs) and `arpo run` all end in `StageRun.execute`: load params, open the MLflow run
   named after the stage, call the stage's task (tasks/stages.py) with the stage table's arguments, write
   `metrics/<stage>.json`, log params, metrics and artifacts, write the stage stamp (flows/spec.py),
   close the run FINISHED or FAILED. Nothing here depends on which stage it is: what differs between
   stages is in the stage table or in the stage module's optional `epoch_history` / `artifacts`.
2. `call(task, ...)` runs a Prefect task as a task run inside a flow run, and as its plain function
   (`task.fn`) outside one. DVC stages run outside Prefect: a flow run needs an API server, and a
   temporary one costs 10-20 s per process on this machine (measured), 8x per `dvc repro`. So under
   DVC there are no Prefect retries (DVC itself re-runs a failed stage); everything else is identical.
3. Paths are relative to the working directory, which is the project root for all three front doors
   (DVC runs commands there; the Prefect deployment's pull step sets it), because params.yaml's suite
   paths are relative too.
4. Outputs of a different configuration are removed before a stage runs, as DVC does: otherwise the
   train stage, which resumes from its last checkpoint, would "resume" an ARPO run's finished epochs
   as a GRPO run. A marker `.arpo/stamps/<stage>.running` holds the key of the attempt in progress; an
   attempt with the same key (a Prefect retry, or the same run restarted after a kill) keeps the
   outputs and resumes.
5. A stage module with `epoch_history(outputs...)` (train) has its per-epoch rows logged at
   step = epoch and written to `plots/<stage>_epochs.csv` (the columns DVC plots); per-iteration
   metrics go to MLflow under `iter/<key>` through the task's `on_metrics` hook.
6. Params are parsed once per process for a given (file contents, preset, overrides): the pipeline flow
   and every stage flow it calls share the same `Params` object (`load_params_once`).
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import os
import shutil
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from arpo_core.config import Params, load_params
from arpo_core.fileio import atomic_open, atomic_write_json
from arpo_core.lock import run_lock
from arpo_core.pipeline.table import Stage
from flows import tracking
from flows.spec import SPECS, stage_key, stage_params, stamp_path, write_stamp
from tasks.stages import TASKS

__all__ = ["PLOT_COLUMNS", "StageRun", "call", "load_params_once", "variant_name", "write_epoch_plot"]

VIEWER_DIR = Path("plots/viewer")
"""Trajectory viewer pages (issue 8), one per trajectory file of a stage, logged under `viewer/`."""
VIEWER_MAX_EPISODES = 400
"""Episodes per viewer page (the first ones in file order); keeps a page a few MB."""
PLOT_COLUMNS = (
    "epoch",
    "rollout/success_rate",
    "rollout/format_error_rate",
    "replay/groups_filled",
    "replay/fill_rate",
    "loss/policy",
    "train/nonzero_adv_frac",
    "time/iteration_s",
)


def call(task: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a Prefect task as a task run inside a flow run, or its plain function outside (decision 2)."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:
        return task(*args, **kwargs)
    return task.fn(*args, **kwargs)


def variant_name(preset: str | None, overrides: Sequence[str] | None, dvc_exp: str | None = None) -> str:
    """Short label of an ablation: 'default', 'quick', 'grpo train.lr=0.001', 'dvc-exp:puffy-walk'."""
    parts = [Path(preset).stem] if preset else []
    parts += list(overrides or ())
    if dvc_exp:
        parts.append(f"dvc-exp:{dvc_exp}")
    return " ".join(parts) or "default"


@cache
def _load(params: str, digest: str, preset: str | None, overrides: tuple[str, ...]) -> Params:
    return load_params(params, list(overrides), preset=preset)


def load_params_once(
    params: str | os.PathLike = "params.yaml", overrides: Sequence[str] = (), preset: str | None = None
) -> Params:
    """Decision 6: `load_params`, parsed once per (file contents, preset, overrides) in a process."""
    digest = hashlib.sha256(Path(params).read_bytes()).hexdigest() if Path(params).exists() else ""
    return _load(str(params), digest, preset, tuple(overrides))


def write_epoch_plot(history: Sequence[dict[str, Any]], path: Path) -> None:
    """One CSV row per epoch with PLOT_COLUMNS (empty cell where a metric is absent)."""
    with atomic_open(path, "w") as f:
        w = csv.writer(f)
        w.writerow(PLOT_COLUMNS)
        for row in history:
            w.writerow(["" if row.get(c) is None else row[c] for c in PLOT_COLUMNS])


class StageRun:
    """One execution of stage `name`: params loaded, MLflow run open while `execute` runs."""

    def __init__(
        self,
        name: str,
        params: str | os.PathLike = "params.yaml",
        preset: str | None = None,
        overrides: Sequence[str] | None = None,
        pipeline_id: str | None = None,
        p: Params | None = None,
    ) -> None:
        self.name = name
        self.spec: Stage = SPECS[name]
        self.module = importlib.import_module(f"arpo_core.pipeline.{self.spec.module}")
        self.root = Path(".")
        self.p = p if p is not None else load_params_once(params, list(overrides or ()), preset=preset)
        self.variant = variant_name(preset, overrides, os.environ.get("DVC_EXP_NAME"))
        self.pipeline_id = pipeline_id
        self.client = tracking.client(self.root)
        self.run_id: str | None = None

    def _outputs(self) -> dict[str, Path]:
        return {k: self.root / v for k, v in self.spec.outputs.items()}

    def execute(self) -> dict[str, float]:
        """Run the stage's task inside the stage's MLflow run; returns its metrics plus
        `time/<stage>_s`. Holds the working tree's run lock (arpo_core/lock.py; re-entrant inside an
        `arpo run`), so a second run fails before touching any output."""
        with run_lock(self.root, command=f"arpo stage {self.name}"):
            return self._execute()

    def _execute(self) -> dict[str, float]:
        key = stage_key(self.p, self.spec, self.root)
        exp = tracking.ensure_experiment(self.client, self.p.project.name, self.root)
        tags = tracking.run_tags(
            self.name,
            self.root,
            {"arpo.key": key, "arpo.variant": self.variant, "arpo.pipeline_id": self.pipeline_id},
        )
        marker = self._prepare_outputs(key)
        self.run_id = tracking.start_run(self.client, exp, self.name, tags)
        tracking.log_params(self.client, self.run_id, stage_params(self.p, self.spec))
        ok = False
        t0 = time.monotonic()
        try:
            result = call(TASKS[self.name], self.name, self.p, self.root, self._log_iteration)
            metrics = {k: float(v) for k, v in result.items() if isinstance(v, int | float)}
            metrics[f"time/{self.name}_s"] = time.monotonic() - t0
            atomic_write_json(self.root / self.spec.metrics, metrics, sort_keys=True)
            self._log_results(metrics)
            write_stamp(self.root, self.spec, key, {"mlflow_run_id": self.run_id})
            marker.unlink(missing_ok=True)
            ok = True
            return metrics
        finally:
            tracking.finish_run(self.client, self.run_id, ok)

    def _log_iteration(self, step: int, metrics: dict[str, float]) -> None:
        """Decision 5: per-iteration metrics under `iter/<key>`."""
        assert self.run_id is not None
        tracking.log_metrics(
            self.client, self.run_id, {f"iter/{k}": v for k, v in metrics.items()}, step=step
        )

    def _prepare_outputs(self, key: str) -> Path:
        """Remove outputs unless an interrupted attempt with the same key left them (decision 4);
        returns the marker of this attempt."""
        marker = stamp_path(self.root, self.name).with_suffix(".running")
        resumable = marker.exists() and marker.read_text().strip() == key
        if not resumable:
            # Directories (a train run's checkpoints) would be resumed, so they go; a file output stays
            # until the stage replaces it atomically at its end (fileio.py), so a stage that fails (disk
            # full, a bug) leaves the previous good file (issue 18).
            for out in self._outputs().values():
                if out.is_dir():
                    shutil.rmtree(out)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(key)
        return marker

    def _log_results(self, metrics: dict[str, float]) -> None:
        c, run_id = self.client, self.run_id
        assert run_id is not None
        history = getattr(self.module, "epoch_history", None)
        if history is not None:  # decision 5
            rows = history(**self._outputs())
            for row in rows:
                tracking.log_metrics(c, run_id, row, step=int(row.get("epoch", 0)))
            plot = self.root / "plots" / f"{self.name}_epochs.csv"
            write_epoch_plot(rows, plot)
            tracking.log_artifacts(c, run_id, plot, "plots")
            last = int(rows[-1].get("epoch", 0)) if rows else 0
            tracking.log_metrics(
                c, run_id, {f"time/{self.name}_s": metrics[f"time/{self.name}_s"]}, step=last
            )
        else:
            tracking.log_metrics(c, run_id, metrics)
        tracking.log_artifacts(c, run_id, self.root / self.spec.metrics, "metrics")
        for path, artifact_dir in self._artifacts():
            tracking.log_artifacts(c, run_id, path, artifact_dir)
        if self.spec.viewer:
            for page in self._write_viewers():
                tracking.log_artifacts(c, run_id, page, "viewer")

    def _artifacts(self) -> list[tuple[Path, str]]:
        """(path, artifact dir): the module's own list, or every output under its table path."""
        custom = getattr(self.module, "artifacts", None)
        if custom is not None:
            return custom(**self._outputs())
        return [(self.root / rel, self.spec.artifacts.get(rel, rel)) for rel in self.spec.outs]

    def _write_viewers(self) -> list[Path]:
        """A self-contained HTML viewer per trajectory file among the stage's artifacts (the Parquet
        files directly inside each artifact path: not the replay buffer inside a checkpoint)."""
        from arpo_core.trajectory import read_trajectories
        from arpo_core.viewer import write_viewer

        pages = []
        for path, _ in self._artifacts():
            files = (
                sorted(path.glob("*.parquet"))
                if path.is_dir()
                else [path]
                if path.suffix == ".parquet"
                else []
            )
            for f in files:
                trajs = read_trajectories(f)[:VIEWER_MAX_EPISODES]
                page = self.root / VIEWER_DIR / self.name / f"{f.stem}.html"
                pages.append(write_viewer(trajs, page, title=f"{self.name}: {f.stem}"))
        return pages
