"""`arpo-train`: the whole pipeline as one Prefect flow composing the stage flows as subflows.

Decisions:
- **Composing flow.** The flow only composes: stage order and the up-to-date check; every stage is its own
  subflow (and MLflow run) with the stage's name, so the Prefect UI, `dvc.yaml` and MLflow show the same
  names.
- **Stage stamps skip.** A stage whose stamp matches its params, inputs and code (flows/spec.py) is skipped
  and says so; `force=True` re-runs everything. Because upstream outputs are part of a stage's key, re-running
  an early stage re-runs everything downstream of it whose inputs actually changed.
- **String parameters.** Deployment parameters are strings (params file, preset name, dotted overrides), the
  same inputs as `arpo run` and `dvc exp run -S`, so a deployment run is reproducible from its parameters
  alone.
- **Progress lines.** Progress: one line when a stage starts, is skipped or ends (with its wall time and
  headline metrics), through `print` with `log_prints` so it reaches the terminal and the Prefect UI.
- **Parent MLflow run.** One MLflow parent run per pipeline run, named by the variant
  (tracking/mlflow_runs.py, decision "Nested runs"), with the variant's full effective params and the keys it
  changes against the params file alone (tag `arpo.changed`); the stage runs it executes are its children. The
  flow run has the same name.
- **Target stages.** `targets` (e.g. ["evaluate"]) runs only those stages and the stages they need (their
  inputs' producers, recursively; `table.upstream`), like `dvc repro TARGET`; the others are not looked at.
- **Ctrl-C never lost.** Ctrl-C is never lost. CPython drops an exception raised while a finalizer or weakref
  callback runs ("Exception ignored in ..."), so a KeyboardInterrupt that lands there vanished and the run
  went on (seen: Ctrl-C during `select`, the pipeline finished). `arpo run` installs `on_interrupt`, which
  records the interrupt before raising; the flow checks the record before every stage and stops there.
- **Lock held throughout.** The flow holds the working tree's lock (flows/services.py `run_lock`) from its
  start to its end, so a deployment's flow run is one run for the lock, as an `arpo run` is (before, each
  stage took and released it, and the pipeline's MLflow run was outside it); inside `arpo run` it is the CLI's
  lock, re-entered. Taking it over from a dead holder closes what that run left open.
- **Clean stop.** A deployment's flow run stops cleanly when told to (the worker's second Ctrl-C sends it
  SIGINT; Prefect's worker, stopping, sends SIGTERM, which Prefect's engine raises as TerminationSignal):
  either ends the flow through its normal exit path, so the stage and pipeline runs end KILLED in
  MLflow (mlflow_runs.py, decision "Never left running"), Prefect records the flow run Crashed, the lock is
  released and the env workers stopped.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

from prefect import flow
from prefect.context import FlowRunContext

from arpo_core.config import flatten, to_dict
from arpo_core.pipeline.table import upstream
from flows.runner import FRONT_DOOR_ENV, load_params_once, variant_name
from flows.services import INTERRUPTED, crash_dead_flow_runs, on_interrupt, run_lock
from flows.spec import SPECS, is_up_to_date
from flows.stage_flows import FLOWS, run_name
from tracking import mlflow_runs

__all__ = ["FLOWS", "INTERRUPTED", "arpo_train", "headline", "on_interrupt"]


HEADLINE_KEYS = (
    "init_policy/parameters",
    "ground/box1h/hit_rate",
    "ground/widget4/hit_rate",
    "ground/miniwob/hit_rate",
    "demos/episodes",
    "sft/loss_last",
    "baseline/success_rate",
    "select/kept",
    "rollout/success_rate",
    "replay/groups_filled",
    "eval/base/greedy/train/success_rate",
    "eval/trained/greedy/train/success_rate",
    "eval/base/greedy/in_domain/success_rate",
    "eval/trained/greedy/in_domain/success_rate",
    "eval/trained/greedy/heldout/success_rate",
    "eval/trained/greedy/out_of_domain/success_rate",
    "compare/arpo/train/delta_vs_base",
    "compare/grpo/train/delta_vs_base",
    "compare/arpo/in_domain/delta_vs_base",
    "compare/grpo/in_domain/delta_vs_base",
    "compare/arpo/trained/delta_vs_base",
    "compare/grpo/trained/delta_vs_base",
    "compare/image_blind/train",
    "compare/image_blind/in_domain",
)


def headline(metrics: dict[str, float]) -> str:
    """The few metrics worth a progress line: 'rollout/success_rate=0.25, replay/groups_filled=1'."""
    return ", ".join(f"{k}={metrics[k]:.3g}" for k in HEADLINE_KEYS if k in metrics)


def changed_params(params: str, p: object) -> dict[str, object]:
    """Decision "Parent MLflow run": {dotted key: value} of the effective params that differ from the params
    file alone."""
    base = flatten(to_dict(load_params_once(params)))
    return {k: v for k, v in flatten(to_dict(p)).items() if base.get(k, object()) != v}


def start_pipeline_run(
    params: str, preset: str | None, overrides: list[str] | None, p: object, pid: str, door: str = "flow"
) -> str:
    """Decision "Parent MLflow run": the parent MLflow run of this pipeline run, named by variant and front
    door (runner.py, decision "Front door tag"); returns its id."""
    c = mlflow_runs.client(".")
    exp = mlflow_runs.ensure_experiment(c, p.project.name, ".")
    variant = variant_name(preset, overrides)
    changed = changed_params(params, p)
    tags = mlflow_runs.run_tags(
        mlflow_runs.PIPELINE,
        ".",
        {
            "arpo.variant": variant,
            "arpo.pipeline_id": pid,
            "arpo.preset": preset,
            "arpo.overrides": " ".join(overrides or ()) or None,
            "arpo.changed": ", ".join(f"{k}={v}" for k, v in sorted(changed.items()))[:5000] or None,
            "arpo.front_door": door,
        },
    )
    run_id = mlflow_runs.start_run(c, exp, f"{variant} · {door}", tags)
    mlflow_runs.log_params(c, run_id, flatten(to_dict(p)))
    return run_id


@flow(name="arpo-train", log_prints=True, flow_run_name=run_name())
def arpo_train(
    params: str = "params.yaml",
    preset: str | None = None,
    overrides: list[str] | None = None,
    force: bool = False,
    targets: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Every stage of the stage table in order (init_policy -> ground -> demos -> sft -> baseline -> select
    -> train -> rft, dpo, kto -> evaluate -> compare), skipping up-to-date stages; with `targets`, only
    those stages and the stages they need (decision "Target stages"). Returns each executed stage's metrics.
    Holds the working tree's lock for the whole run (decision "Lock held throughout")."""
    ctx = FlowRunContext.get()
    door = pipeline_front_door(ctx)
    old_door = os.environ.get(FRONT_DOOR_ENV)
    os.environ[FRONT_DOOR_ENV] = door  # the stage runs' tag (runner.py, decision "Front door tag")
    old_sigint = _record_interrupts()
    try:
        with run_lock(".", command=f"arpo-train ({door})"):
            if ctx is not None and ctx.flow_run is not None:
                crash_dead_flow_runs()  # services.py, decision "Dead run cleanup"
            return _pipeline(params, preset, overrides, force, targets, ctx, door)
    finally:
        if old_sigint is not None:
            signal.signal(signal.SIGINT, old_sigint)
        if old_door is None:
            os.environ.pop(FRONT_DOOR_ENV, None)
        else:
            os.environ[FRONT_DOOR_ENV] = old_door


def _record_interrupts() -> object | None:
    """Decision "Ctrl-C never lost" for a deployment's flow run (where no CLI installed it): SIGINT goes
    through `on_interrupt` while the flow runs, when it is Python's default handler and this is the main
    thread; returns the handler to restore, or None when nothing was changed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    current = signal.getsignal(signal.SIGINT)
    if current is not signal.default_int_handler:
        return None
    INTERRUPTED.clear()
    signal.signal(signal.SIGINT, on_interrupt)
    return current


def pipeline_front_door(ctx: object) -> str:
    """runner.py, decision "Front door tag": `arpo run` (set by the CLI), `deployment <flow>/<name>` for a
    deployment's flow run, else `flow` (the flow called some other way)."""
    if os.environ.get(FRONT_DOOR_ENV):
        return os.environ[FRONT_DOOR_ENV]
    fr = getattr(ctx, "flow_run", None)
    if fr is not None and fr.deployment_id is not None:
        from prefect.runtime import deployment

        return f"deployment arpo-train/{deployment.name or fr.deployment_id}"
    return "flow"


def _pipeline(
    params: str,
    preset: str | None,
    overrides: list[str] | None,
    force: bool,
    targets: list[str] | None,
    ctx: object,
    door: str,
) -> dict[str, dict[str, float]]:
    p = load_params_once(params, list(overrides or ()), preset=preset)  # fail before any stage on a bad key
    wanted = upstream(targets) if targets else tuple(FLOWS)  # an unknown name fails here, before any stage
    pipeline_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else uuid.uuid4().hex
    print(
        f"[arpo-train] {variant_name(preset, overrides)}: project {p.project.name!r}, seed {p.project.seed}"
    )
    results: dict[str, dict[str, float]] = {}
    t_all = time.monotonic()
    parent = start_pipeline_run(params, preset, overrides, p, pipeline_id, door)
    c = mlflow_runs.client(".")
    error: BaseException | None = None
    try:
        for i, name in enumerate(wanted, 1):
            stage_flow = FLOWS[name]
            tag = f"[arpo-train] {i}/{len(wanted)} {name}"
            if INTERRUPTED.is_set():  # decision "Ctrl-C never lost": an interrupt the interpreter swallowed
                print(f"{tag}: not started (interrupted)")
                raise KeyboardInterrupt(f"interrupted before stage {name}")
            if not force and is_up_to_date(p, SPECS[name], Path(".")):
                print(f"{tag}: up to date, skipped")
                mlflow_runs.set_tags(c, parent, {f"arpo.skipped.{name}": "up to date"})
                continue
            print(f"{tag}: running")
            t0 = time.monotonic()
            results[name] = stage_flow(
                params=params,
                preset=preset,
                overrides=overrides,
                pipeline_id=pipeline_id,
                parent_run_id=parent,
            )
            print(f"{tag}: done in {time.monotonic() - t0:.0f} s  {headline(results[name])}")
    except BaseException as e:
        # KILLED for an interrupt, FAILED for an error (mlflow_runs.py, decision "Never left running")
        error = e
        raise
    finally:
        mlflow_runs.finish_run(c, parent, mlflow_runs.end_status(error))
    print(f"[arpo-train] finished in {time.monotonic() - t_all:.0f} s")
    return results
