"""Running one stage with tracking: the part every stage flow shares, also used by `arpo stage` (DVC).

Decisions:
- **One code path.** One code path for the three front doors. A stage flow (Prefect), `arpo stage NAME` (what
  each DVC stage's `cmd` runs) and `arpo run` all end in `StageRun.execute`: load params, open the MLflow run
  named after the stage, call the stage's task (tasks/stages.py) with the stage table's arguments, write
  `metrics/<stage>.json`, log params, metrics and artifacts, write the stage stamp (flows/spec.py),
  close the run FINISHED or FAILED. Nothing here depends on which stage it is: what differs between
  stages is in the stage object (arpo_core/pipeline/stage.py): its fields and tracking hooks.
- **Prefect tasks outside flows.** `call(task, ...)` runs a Prefect task as a task run inside a flow run, and
  as its plain function (`task.fn`) outside one. DVC stages run outside Prefect: a flow run needs an API
  server, and a temporary one costs 10-20 s per process on this machine (measured), 8x per `dvc repro`. So
  under DVC there are no Prefect retries (DVC itself re-runs a failed stage); everything else is identical.
- **Relative paths.** Paths are relative to the working directory, which is the project root for all three
  front doors (DVC runs commands there; the Prefect deployment's pull step sets it), because params.yaml's
  suite paths are relative too.
- **Staged outputs.** A stage writes its outputs beside the previous ones and they replace them only when it
  succeeds (issue 34 item 4): each output path `dir/name` is passed to the stage as its staging path
  `dir/.name.staging` (same filesystem, so the swap is a rename; git- and DVC-ignored), and after the
  stage returns every staged output is moved into place (`commit_outputs`: a file by one atomic
  rename, a directory by renaming the previous one to `dir/.name.previous`, the staged one into place,
  then deleting the previous; a kill between the two renames is repaired at the next start, which
  puts the previous output back). A stage that fails (disk full, a bad input, a bug, a kill) leaves
  the previous outputs, their stamp and everything downstream as they were. The staging area belongs
  to one configuration: a marker `.arpo/stamps/<stage>.running` holds the key of the attempt in
  progress; an attempt with the same key (a Prefect retry, or the same run restarted after a kill)
  keeps the staged outputs and resumes from them (the train stage from its last epoch checkpoint,
  which lives in the staging area while it runs); an attempt with another key starts from an empty
  one, so the train stage never "resumes" an ARPO run's finished epochs as a GRPO run. The price: room
  for the old and the new outputs until the swap.
- **Set aside, not deleted.** What an interrupted attempt with another key staged is moved to
  `dir/.name.set-aside` (one per output: the next set-aside replaces it; git- and DVC-ignored), not
  deleted, and the stage says so in one line: which params and which files (code, data, inputs) differ
  from the attempt that made it, the commit it was made at, its size, and how to resume it (restore that
  configuration and move it back to the staging path) or free the room. Before, any change to a
  stage's params or code deleted its staging area without a word: pulling a change that trains
  nothing differently (the screen cache) into the folder of a grounding run stopped between sessions
  deleted its 5,357 steps of checkpoints (docs/results.md, "The reader at 2x with lorem names").
  The marker holds what the message needs: the key, the stage's params, its dependency files' hashes
  and the checkout's commit.
- **Epoch history.** A stage with an `epoch_history(outputs...)` hook (train) has its per-epoch rows logged at
  step = epoch and written to `plots/<stage>_epochs.csv` (the columns DVC plots); per-iteration
  metrics go to MLflow under `iter/<key>` through the task's `on_metrics` hook.
- **Params parsed once.** Params are parsed once per process for a given (file contents, preset, overrides):
  the pipeline flow and every stage flow it calls share the same `Params` object (`load_params_once`).
- **What a run logs.** What a run logs: its effective params (own + upstream, flows/spec.py,
  decision "Effective params") plus the stage stage's `tracked_params(p)` hook where it has one (the trained
  policy's `method`); the summary metrics to `metrics/<stage>.json` and the breakdowns to
  `metrics/details/<stage>.json` (spec.py, decision "Short metrics files"), all of them to MLflow; each
  `policy` artifact as an MLflow model (tracking/policy_model.py) linked to the run's metrics; the
  evaluations' metrics linked to the models of the stages that produced the evaluated policies (the stage's
  `model_inputs`, role -> input argument).
- **Prefect artifacts.** Inside a Prefect flow run each stage publishes artifacts: a Markdown summary
  (variant, headline metrics, MLflow run) and, where it evaluated policies, a table of success per role, mode
  and split.
- **Viewer pages rewritten.** Viewer pages of a stage are rewritten as a whole: the stage's page directory is
  emptied first, so a re-run with another configuration leaves no pages of the earlier one.
- **Front door tag.** Every run says which front door started it (tag `arpo.front_door`: `arpo run`,
  `deployment arpo-train/<name>`, `dvc`, `dvc exp`, `arpo stage`), and a pipeline run's name ends with it
  (`quick · arpo run`, `quick · deployment arpo-train/quick`): a deployment run and an `arpo run` of
  the same preset were two runs named `quick` (issue 34 item 6).
- **Headline metric first.** The metric a user compares first comes first in MLflow (issue 32 item 3).
  MLflow's compare page plots the first metric key in sort order and its chart view opens on the section of
  keys without a `/`; a stage's `headline(p, metrics)` hook (evaluate, rft / dpo / kto, train, compare) gives
  that metric again under a key with no `/` and a leading `_`, which sorts before every `eval/...` key:
  `_success_rate` (the trained policy's greedy in-domain success), `_delta_vs_base` (compare: the
  trained arm's paired delta), `_rollout_success_rate` (train). A stage run that tracks a
  `method` different from the stage's name is named with it, `evaluate · grpo`, `train · arpo`,
  `compare · arpo`, so the runs list tells the arms apart (before: all named `evaluate`).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from arpo_core.config import Params, load_params
from arpo_core.infra.fileio import atomic_open, atomic_write_json, tree_size
from arpo_core.pipeline.table import Stage
from flows.services import run_lock
from flows.spec import (
    SPECS,
    details_path,
    effective_params,
    file_hashes,
    matching_stamp,
    read_stamp,
    split_metrics,
    stage_key,
    stage_params,
    stamp_path,
    write_stamp,
)
from tasks.stages import TASKS
from tracking import mlflow_runs

__all__ = [
    "FRONT_DOOR_ENV",
    "PLOT_COLUMNS",
    "StageRun",
    "call",
    "commit_outputs",
    "front_door",
    "load_params_once",
    "previous_path",
    "read_marker",
    "recover_outputs",
    "set_aside_message",
    "set_aside_path",
    "staging_path",
    "variant_name",
    "write_epoch_plot",
]

VIEWER_DIR = Path("plots/viewer")
"""Trajectory viewer pages (issue 8), one per trajectory file of a stage, logged under `viewer/`."""
KNOWN_POLICIES = ("base", "rft", "dpo", "kto", "grpo", "arpo", "grpo_blind", "arpo_blind")
"""Evaluation files are named by the policy they evaluated (`data/eval/base.parquet`)."""
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


def staging_path(out: Path) -> Path:
    """Decision "Staged outputs": where a stage writes output `out` while it runs."""
    return out.parent / f".{out.name}.staging"


def previous_path(out: Path) -> Path:
    """Decision "Staged outputs": where the previous output `out` waits during the swap."""
    return out.parent / f".{out.name}.previous"


def set_aside_path(out: Path) -> Path:
    """Decision "Set aside, not deleted": where an interrupted attempt's staged output waits when an attempt
    with another key starts."""
    return out.parent / f".{out.name}.set-aside"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover_outputs(outs: Sequence[Path]) -> None:
    """Decision "Staged outputs": finish or undo a swap a kill interrupted. A previous output whose place is
    empty goes back (the staged one stays, for a resume); one whose place is filled is deleted."""
    for out in outs:
        prev = previous_path(out)
        if prev.exists():
            if out.exists():
                _remove(prev)
            else:
                os.replace(prev, out)


def read_marker(path: Path) -> dict[str, Any] | None:
    """A running marker (decision "Set aside, not deleted"): its record, `{"key": ...}` alone for a marker
    written before it held more (the key as plain text), None when there is none."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return {"key": text}
    return record if isinstance(record, dict) else {"key": text}


def _holds(path: Path) -> bool:
    """A staged output with something in it (an empty directory is nothing to keep)."""
    return path.is_file() or path.is_symlink() or (path.is_dir() and any(path.iterdir()))


def _differing(a: dict[str, Any], b: dict[str, Any], most: int = 4) -> str:
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def set_aside_message(
    stage: str,
    before: dict[str, Any] | None,
    now: dict[str, Any],
    outs: Sequence[Path],
    root: Path,
    replaced: Sequence[Path] = (),
) -> str:
    """The one line a stage says when it sets an interrupted attempt's staged outputs aside (`replaced`:
    the outputs whose older set-aside this one took the place of)."""
    if before is None or "params" not in before:
        why = "by an attempt whose configuration was not recorded"
    else:
        params = _differing(before["params"], now["params"])
        files = _differing(before.get("files") or {}, now["files"])
        parts = [f"params {params}" if params else "", f"files {files}" if files else ""]
        why = (
            "with other " + " and other ".join(x for x in parts if x)
            if params or files
            else "with another key"
        )
        if before.get("commit"):
            why += f" (at commit {before['commit']})"
    size = sum(tree_size(set_aside_path(out)) for out in outs) / 2**20
    places = ", ".join(
        f"{set_aside_path(out).relative_to(root)} (back to {staging_path(out).relative_to(root)} to resume)"
        if out.is_relative_to(root)
        else str(set_aside_path(out))
        for out in outs
    )
    return (
        f"[{stage}] an interrupted attempt's staged outputs were made {why}: set aside, not deleted, "
        f"{size:.0f} MB: {places}. To resume them, run that configuration with them moved back; "
        "otherwise delete them"
        + (
            f" (this replaced an older set-aside of {', '.join(o.name for o in replaced)})"
            if replaced
            else ""
        )
    )


def commit_outputs(outs: Sequence[Path]) -> None:
    """Decision "Staged outputs": move every staged output into place; an output the stage did not write this
    time is removed (what it held came from an earlier run)."""
    for out in outs:
        staged, prev = staging_path(out), previous_path(out)
        if not staged.exists():
            _remove(out)
            continue
        if staged.is_dir() and out.exists():
            _remove(prev)
            os.replace(out, prev)
            os.replace(staged, out)
            _remove(prev)
        else:  # a file (or a directory with nothing in its place): one atomic rename
            if out.is_dir():
                _remove(out)
            os.replace(staged, out)


def call(task: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a Prefect task as a task run inside a flow run, or its plain function outside
    (decision "Prefect tasks outside flows")."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:
        return task(*args, **kwargs)
    return task.fn(*args, **kwargs)


FRONT_DOOR_ENV = "ARPO_FRONT_DOOR"
"""Decision "Front door tag": the front door a pipeline run came through, set for its stage runs."""


def front_door() -> str:
    """Decision "Front door tag": 'dvc' / 'dvc exp' (a DVC stage), else what the pipeline run set ('arpo run',
    'deployment arpo-train/quick'), else 'arpo stage'."""
    if os.environ.get("DVC_STAGE"):
        return "dvc exp" if os.environ.get("DVC_EXP_NAME") else "dvc"
    return os.environ.get(FRONT_DOOR_ENV) or "arpo stage"


def variant_name(preset: str | None, overrides: Sequence[str] | None, dvc_exp: str | None = None) -> str:
    """Label of a variant, the name of its pipeline run: 'default', 'quick',
    'quick | train.replay.enabled=false', 'dvc-exp:puffy-walk'."""
    parts = [Path(preset).stem] if preset else []
    parts += list(overrides or ())
    if dvc_exp:
        parts.append(f"dvc-exp:{dvc_exp}")
    return " | ".join(parts) or "default"


@cache
def _load(params: str, digest: str, preset: str | None, overrides: tuple[str, ...]) -> Params:
    return load_params(params, list(overrides), preset=preset)


def load_params_once(
    params: str | os.PathLike = "params.yaml", overrides: Sequence[str] = (), preset: str | None = None
) -> Params:
    """Decision "Params parsed once": `load_params`, parsed once per (file contents, preset, overrides) in a
    process."""
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
        parent_run_id: str | None = None,
    ) -> None:
        self.name = name
        self.spec: Stage = SPECS[name]
        self.root = Path(".")
        self.p = p if p is not None else load_params_once(params, list(overrides or ()), preset=preset)
        self.variant = variant_name(preset, overrides, os.environ.get("DVC_EXP_NAME"))
        self.pipeline_id = pipeline_id
        self.parent_run_id = parent_run_id
        self.model_ids: dict[str, str] = {}
        self.client = mlflow_runs.client(self.root)
        self.run_id: str | None = None

    def _outputs(self) -> dict[str, Path]:
        return {k: self.root / v for k, v in self.spec.outputs.items()}

    def execute(self) -> dict[str, float]:
        """Run the stage's task inside the stage's MLflow run; returns its metrics plus
        `time/<stage>_s`. Holds the working tree's run lock (arpo_core/infra/lock.py; re-entrant inside an
        `arpo run`), so a second run fails before touching any output."""
        with run_lock(self.root, command=f"arpo stage {self.name}"):
            return self._execute()

    def _execute(self) -> dict[str, float]:
        key = stage_key(self.p, self.spec, self.root)
        exp = mlflow_runs.ensure_experiment(self.client, self.p.project.name, self.root)
        tags = mlflow_runs.run_tags(
            self.name,
            self.root,
            {
                "arpo.key": key,
                "arpo.variant": self.variant,
                "arpo.pipeline_id": self.pipeline_id,
                "arpo.front_door": front_door(),  # decision "Front door tag"
            },
        )
        marker = self._prepare_outputs(key)
        self.run_id = mlflow_runs.start_run(self.client, exp, self.run_name(), tags, self.parent_run_id)
        mlflow_runs.log_params(self.client, self.run_id, self.params())
        error: BaseException | None = None
        t0 = time.monotonic()
        try:
            staged = {k: staging_path(v) for k, v in self._outputs().items()}  # decision "Staged outputs"
            result = call(TASKS[self.name], self.name, self.p, self.root, self._log_iteration, staged)
            commit_outputs(list(self._outputs().values()))
            metrics = {k: float(v) for k, v in result.items() if isinstance(v, int | float)}
            if self.spec.headline is not None:  # decision "Headline metric first"
                metrics.update(self.spec.headline(self.p, metrics))
            metrics[f"time/{self.name}_s"] = time.monotonic() - t0
            summary, details = split_metrics(metrics)
            atomic_write_json(self.root / self.spec.metrics, summary, sort_keys=True)
            atomic_write_json(self.root / details_path(self.spec), details, sort_keys=True)
            self._log_results(metrics)
            extra = {"mlflow_run_id": self.run_id, "mlflow_model_ids": self.model_ids}
            write_stamp(self.root, self.spec, key, extra)
            marker.unlink(missing_ok=True)
            publish_artifacts(self.name, self.variant, summary, metrics, self.run_id)
            return metrics
        except BaseException as e:
            # KILLED for an interrupt, FAILED for an error (mlflow_runs.py, decision "Never left running")
            error = e
            raise
        finally:
            mlflow_runs.finish_run(self.client, self.run_id, mlflow_runs.end_status(error))

    def run_name(self) -> str:
        """Decision "Headline metric first": the stage, with the arm when the run tracks one (`evaluate ·
        grpo`)."""
        method = str(self.params().get("method") or "")
        return f"{self.name} · {method}" if method and method != self.name else self.name

    def params(self) -> dict[str, Any]:
        """Decision "What a run logs": what this run logs as params."""
        extra = self.spec.tracked_params
        return {**effective_params(self.p, self.spec), **(extra(self.p) if extra else {})}

    def _log_iteration(self, step: int, metrics: dict[str, float]) -> None:
        """Decision "Epoch history": per-iteration metrics under `iter/<key>`."""
        assert self.run_id is not None
        mlflow_runs.log_metrics(
            self.client, self.run_id, {f"iter/{k}": v for k, v in metrics.items()}, step=step
        )

    def _prepare_outputs(self, key: str) -> Path:
        """Decision "Staged outputs": repair an interrupted swap, empty the staging area unless an interrupted
        attempt with the same key left it (then it is resumed); returns the marker of this attempt. The
        previous outputs are not touched."""
        outs = list(self._outputs().values())
        recover_outputs(outs)
        marker = stamp_path(self.root, self.name).with_suffix(".running")
        before = read_marker(marker)
        if before is not None and before.get("key") == key:
            return marker
        now = self._marker(key)
        held = [out for out in outs if _holds(staging_path(out))]
        if held:  # decision "Set aside, not deleted"
            replaced = [
                out for out in held if set_aside_path(out).exists() or set_aside_path(out).is_symlink()
            ]
            for out in held:
                _remove(set_aside_path(out))
                os.replace(staging_path(out), set_aside_path(out))
            print(set_aside_message(self.name, before, now, held, self.root, replaced), flush=True)
        for out in outs:
            _remove(staging_path(out))
        atomic_write_json(marker, now, indent=1, sort_keys=True)
        return marker

    def _marker(self, key: str) -> dict[str, Any]:
        """What the running marker records (decision "Set aside, not deleted")."""
        from arpo_core.pipeline.ground import source_commit

        commit = source_commit(self.root)
        return {
            "key": key,
            "params": json.loads(json.dumps(stage_params(self.p, self.spec), default=str)),
            "files": file_hashes(self.spec.deps, self.root),
            "commit": commit and commit["commit"] + ("+changes" if commit["dirty"] else ""),
        }

    def _log_results(self, metrics: dict[str, float]) -> None:
        c, run_id = self.client, self.run_id
        assert run_id is not None
        last = 0
        if self.spec.epoch_history is not None:  # decision "Epoch history"
            rows = self.spec.epoch_history(**self._outputs())
            for row in rows:
                mlflow_runs.log_metrics(c, run_id, row, step=int(row.get("epoch", 0)))
            plot = self.root / "plots" / f"{self.name}_epochs.csv"
            write_epoch_plot(rows, plot)
            from arpo_core.analysis.report import plot_epoch_panels
            from flows.spec import EPOCH_PANELS

            plot_epoch_panels(rows, EPOCH_PANELS, plot.with_suffix(".png"))
            mlflow_runs.log_artifacts(c, run_id, plot, "plots")
            mlflow_runs.log_artifacts(c, run_id, plot.with_suffix(".png"), "plots")
            last = int(rows[-1].get("epoch", 0)) if rows else 0
            mlflow_runs.log_metrics(
                c, run_id, {f"time/{self.name}_s": metrics[f"time/{self.name}_s"]}, step=last
            )
        else:
            self._log_linked_metrics(metrics)
        mlflow_runs.log_artifacts(c, run_id, self.root / self.spec.metrics, "metrics")
        mlflow_runs.log_artifacts(c, run_id, self.root / details_path(self.spec), "metrics")
        for path, artifact_dir in self._artifacts():
            if artifact_dir == "policy":
                self._log_model(path, last)
            else:
                mlflow_runs.log_artifacts(c, run_id, path, artifact_dir)
        if self.spec.viewer:
            for page in self._write_viewers():
                mlflow_runs.log_artifacts(c, run_id, page, "viewer")

    def _log_linked_metrics(self, metrics: dict[str, float]) -> None:
        """Decision "What a run logs": metrics of role `r` (`eval/r/...`) linked to the model of the stage
        whose output the stage's `model_inputs[r]` argument reads; the rest plainly."""
        assert self.run_id is not None
        rest = dict(metrics)
        for role, arg in self.spec.model_inputs.items():
            model_id = self._upstream_model(self.spec.inputs.get(arg))
            mine = {k: v for k, v in metrics.items() if k.startswith(f"eval/{role}/")}
            if model_id and mine:
                mlflow_runs.log_metrics(self.client, self.run_id, mine, model_id=model_id)
                rest = {k: v for k, v in rest.items() if k not in mine}
        mlflow_runs.log_metrics(self.client, self.run_id, rest)

    def _upstream_model(self, path: Any) -> str | None:
        """The MLflow model id the stage that wrote `path` logged for its policy (from its stamp)."""
        for s in SPECS.values():
            if isinstance(path, str) and path in s.outs:
                stamp = matching_stamp(self.p, s, self.root) or read_stamp(self.root, s.name) or {}
                return next(iter((stamp.get("mlflow_model_ids") or {}).values()), None)
        return None

    def _log_model(self, path: Path, step: int) -> None:
        """Decision "What a run logs": the policy checkpoint at `path` as the run's MLflow model, named by its
        method (`arpo`, `grpo`, `rft`, ...) or the stage."""
        from tracking.policy_model import log_policy_model

        if not (path / "config.json").exists() and not any(path.glob("*")):
            return
        assert self.run_id is not None
        name = str(self.params().get("method", self.name))
        pol = self.p.policy
        config = {
            "system_prompt": pol.system_prompt,
            "history_images": pol.history_images,
            "max_new_tokens": pol.max_new_tokens,
        }
        uri = mlflow_runs.tracking_uri(self.root)
        self.model_ids[name] = log_policy_model(uri, self.run_id, path, name, config, step=step)

    def _artifacts(self) -> list[tuple[Path, str]]:
        """(path, artifact dir): the stage's `list_artifacts`, or every output under its table path."""
        if self.spec.list_artifacts is not None:
            return self.spec.list_artifacts(**self._outputs())
        return [(self.root / rel, self.spec.artifacts.get(rel, rel)) for rel in self.spec.outs]

    def _write_viewers(self) -> list[Path]:
        """A self-contained HTML viewer per trajectory file among the stage's artifacts (the Parquet
        files directly inside each artifact path: not the replay buffer inside a checkpoint)."""
        from arpo_core.analysis.viewer import write_viewer
        from arpo_core.trajectory import read_trajectories

        pages = []
        stage_dir = self.root / VIEWER_DIR / self.name
        if stage_dir.exists():  # decision "Viewer pages rewritten"
            shutil.rmtree(stage_dir)
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
                page = stage_dir / f"{f.stem}.html"
                stem = f.stem.removesuffix("-sampled")
                label = stem if stem in KNOWN_POLICIES else str(self.params().get("method", ""))
                pages.append(
                    write_viewer(
                        trajs,
                        page,
                        title=f"{self.run_name()}: {f.name}, {len(trajs)} episodes",
                        policies=[label] * len(trajs),
                        sources=[f.as_posix()] * len(trajs),
                    )
                )
        return pages


# ------------------------------------------------------------------------------------------------
# Prefect artifacts (decision "Prefect artifacts")

SUMMARY_ROWS = 24


def evaluation_rows(metrics: dict[str, float]) -> list[dict[str, Any]]:
    """One row per (role, mode, split) of `eval/<role>/<mode>/<split>/success_rate` keys, with the 95%
    interval and the episode count: the table artifact of a stage that evaluated policies."""
    rows = []
    for k, v in sorted(metrics.items()):
        parts = k.split("/")
        if len(parts) == 5 and parts[0] == "eval" and parts[4] == "success_rate":
            base = k.removesuffix("/success_rate")
            rows.append(
                {
                    "policy": parts[1],
                    "mode": parts[2],
                    "split": parts[3],
                    "success": round(v, 4),
                    "ci95_low": round(metrics.get(f"{base}/success_ci_low", float("nan")), 4),
                    "ci95_high": round(metrics.get(f"{base}/success_ci_high", float("nan")), 4),
                    "episodes": int(metrics.get(f"{base}/episodes", 0)),
                }
            )
    return rows


def summary_markdown(stage: str, variant: str, summary: dict[str, float], run_id: str | None) -> str:
    """The Markdown artifact of a stage: variant, MLflow run, the first SUMMARY_ROWS summary metrics."""
    lines = [f"# {stage} ({variant})", "", f"MLflow run `{run_id}`", "", "| metric | value |", "|---|---|"]
    for k, v in sorted(summary.items())[:SUMMARY_ROWS]:
        lines.append(f"| `{k}` | {v:.4g} |")
    if len(summary) > SUMMARY_ROWS:
        lines.append(f"| ... | {len(summary) - SUMMARY_ROWS} more in metrics/{stage}.json |")
    return "\n".join(lines) + "\n"


def publish_artifacts(
    stage: str, variant: str, summary: dict[str, float], metrics: dict[str, float], run_id: str | None
) -> list[str]:
    """Decision "Prefect artifacts": the stage's Prefect artifacts, inside a flow run only (none under DVC);
    returns their keys."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    slug = stage.replace("_", "-")
    create_markdown_artifact(
        summary_markdown(stage, variant, summary, run_id), key=f"{slug}-summary", description=variant
    )
    keys = [f"{slug}-summary"]
    rows = evaluation_rows(metrics)
    if rows:
        create_table_artifact(rows, key=f"{slug}-evaluation", description=f"{stage}: success, 95% CI")
        keys.append(f"{slug}-evaluation")
    return keys
