"""Running one stage with tracking: the part every stage flow shares, also used by `arpo stage` (DVC).

Decisions:
1. One code path for the three front doors. A stage flow (Prefect), `arpo stage NAME` (what each DVC
   stage's `cmd` runs) and `arpo run` all end in `StageRun`: load params, open the MLflow run named
   after the stage, call the stage's task, write `metrics/<stage>.json`, log params, metrics and
   artifacts, write the stage stamp (flows/spec.py), close the run FINISHED or FAILED.
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
5. Train per-epoch summaries (from the checkpoint's history) go to `plots/train_epochs.csv`: one row
   per epoch, the columns DVC plots (success rate, replay fills, loss).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from arpo_core.config import Params, load_params
from arpo_core.fileio import atomic_open, atomic_write_json
from flows import tracking
from flows.spec import SPECS, stage_key, stage_params, stamp_path, write_stamp

__all__ = ["PATHS", "PLOT_COLUMNS", "StageRun", "call", "variant_name", "write_epoch_plot"]

# Default locations of every stage's outputs (the same paths as dvc.yaml's outs).
PATHS: dict[str, Path] = {
    "init_policy": Path("models/init"),
    "ground": Path("models/grounded"),
    "demos": Path("data/demos/demos.parquet"),
    "sft": Path("models/base"),
    "baseline": Path("data/baseline"),
    "select": Path("data/selected_tasks.json"),
    "train": Path("models/arpo"),
    "evaluate": Path("data/eval"),
}
EPOCH_PLOT = Path("plots/train_epochs.csv")
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


def write_epoch_plot(history: Sequence[dict[str, Any]], path: Path = EPOCH_PLOT) -> None:
    """One CSV row per epoch with PLOT_COLUMNS (empty cell where a metric is absent)."""
    with atomic_open(path, "w") as f:
        w = csv.writer(f)
        w.writerow(PLOT_COLUMNS)
        for row in history:
            w.writerow(["" if row.get(c) is None else row[c] for c in PLOT_COLUMNS])


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, data, sort_keys=True)


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
        self.spec = SPECS[name]
        self.root = Path(".")
        self.p = p if p is not None else load_params(params, list(overrides or ()), preset=preset)
        self.variant = variant_name(preset, overrides, os.environ.get("DVC_EXP_NAME"))
        self.pipeline_id = pipeline_id
        self.client = tracking.client(self.root)
        self.run_id: str | None = None

    def path(self, stage: str) -> Path:
        """Default output path of `stage` (relative to the project root)."""
        return self.root / PATHS[stage]

    def execute(self, work: Callable[[StageRun], dict[str, Any]]) -> dict[str, float]:
        """Run `work(self)` (the stage's task call) inside the stage's MLflow run; returns its metrics
        plus `time/<stage>_s`."""
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
            metrics = {k: float(v) for k, v in work(self).items() if isinstance(v, int | float)}
            metrics[f"time/{self.name}_s"] = time.monotonic() - t0
            _write_json(self.root / self.spec.metrics, metrics)
            self._log_results(metrics)
            write_stamp(self.root, self.spec, key, {"mlflow_run_id": self.run_id})
            marker.unlink(missing_ok=True)
            ok = True
            return metrics
        finally:
            tracking.finish_run(self.client, self.run_id, ok)

    def _prepare_outputs(self, key: str) -> Path:
        """Remove outputs unless an interrupted attempt with the same key left them (decision 4);
        returns the marker of this attempt."""
        marker = stamp_path(self.root, self.name).with_suffix(".running")
        resumable = marker.exists() and marker.read_text().strip() == key
        if not resumable:
            for rel in self.spec.outs:
                out = self.root / rel
                if out.is_dir():
                    shutil.rmtree(out)
                elif out.exists():
                    out.unlink()
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(key)
        return marker

    def _log_results(self, metrics: dict[str, float]) -> None:
        c, run_id = self.client, self.run_id
        assert run_id is not None
        if self.name == "train":
            last = self._log_train_history()
            tracking.log_metrics(c, run_id, {"time/train_s": metrics["time/train_s"]}, step=last)
        else:
            tracking.log_metrics(c, run_id, metrics)
        tracking.log_artifacts(c, run_id, self.root / self.spec.metrics, "metrics")
        artifacts = self._artifacts()
        for rel, artifact_path in artifacts:
            tracking.log_artifacts(c, run_id, rel, artifact_path)
        if self.name != "demos":  # oracle demos: nothing of the policy's to look at
            sources = [path for path, kind in artifacts if kind == "trajectories" and path.exists()]
            for page in self._write_viewers(sources):
                tracking.log_artifacts(c, run_id, page, "viewer")

    def _write_viewers(self, sources: Sequence[Path]) -> list[Path]:
        """A self-contained HTML viewer per trajectory file under `sources` (episodes step by step)."""
        from arpo_core.trajectory import read_trajectories
        from arpo_core.viewer import write_viewer

        pages = []
        for path in sources:
            files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
            for f in files:
                trajs = read_trajectories(f)[:VIEWER_MAX_EPISODES]
                out = self.root / VIEWER_DIR / self.name / f"{f.stem}.html"
                pages.append(write_viewer(trajs, out, title=f"{self.name}: {f.stem}"))
        return pages

    def _log_train_history(self) -> int:
        """Per-epoch summaries at step=epoch under the plain keys (so the run's latest value equals
        metrics/train.json) and the epoch plot (decision 4)."""
        from arpo_core.trainer import latest_checkpoint

        ckpt = latest_checkpoint(self.path("train"))
        history = json.loads((ckpt / "state.json").read_text())["history"] if ckpt else []
        for row in history:
            tracking.log_metrics(self.client, self.run_id, row, step=int(row.get("epoch", 0)))
        write_epoch_plot(history, self.root / EPOCH_PLOT)
        return int(history[-1].get("epoch", 0)) if history else 0

    def _artifacts(self) -> list[tuple[Path, str]]:
        """(path, artifact dir) pairs: trajectories, policies and the last checkpoint (issue 6)."""
        r = self.root
        if self.name in ("init_policy", "ground", "sft"):
            return [(self.path(self.name), "policy")]
        if self.name in ("demos", "baseline", "evaluate"):
            return [(r / self.spec.outs[0], "trajectories")]
        if self.name == "select":
            return [(self.path("select"), "selection")]
        if self.name == "train":
            from arpo_core.trainer import latest_checkpoint

            out = self.path("train")
            ckpt = latest_checkpoint(out)
            pairs = [(out / "policy", "policy"), (out / "trajectories", "trajectories")]
            return pairs + ([(ckpt, f"checkpoint/{ckpt.name}")] if ckpt else []) + [(r / EPOCH_PLOT, "plots")]
        return []
