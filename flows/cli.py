"""The `arpo` command: the front door of the pipeline (it may import Prefect; arpo_core may not).

Errors are one line (`error: <what went wrong>`, exit 1; bad params exit 2) unless `arpo --debug ...`
(or ARPO_DEBUG=1) asks for the traceback: without it, Prefect's flow and task run loggers (and
selenium's) also log a failure as its message only, not the traceback they would print three times over.
A Ctrl-C ends a run with exit 130 and one line, after its Prefect and MLflow runs are marked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import typer
import yaml

from arpo_core.config import ConfigError, Params, load_params, to_dict
from arpo_core.pipeline.table import STAGE_NAMES

DEBUG_ENV = "ARPO_DEBUG"


def _debug() -> bool:
    return "--debug" in sys.argv[1:2] or os.environ.get(DEBUG_ENV) == "1"


class _OneLineRecords(logging.Filter):
    """Drops the traceback of a log record (the message stays): Prefect's run loggers without --debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            exc = record.exc_info[1]
            record.exc_info, record.exc_text = None, None
            if exc is not None and str(exc) not in record.getMessage():
                record.msg, record.args = f"{record.getMessage()}: {exc}", ()
        return True


class OneLineErrors(typer.Typer):
    """The `arpo` app: an unexpected exception ends the command with one line naming it, exit 1; the
    traceback only with --debug."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        if _debug():
            return super().__call__(*args, **kwargs)
        # selenium: a Ctrl-C while chromedriver starts made it log "Error stopping service after a
        # failed start." with a traceback (the driver had the same SIGINT); the message is enough.
        for name in ("prefect.flow_runs", "prefect.task_runs", "selenium.webdriver.common.service"):
            logging.getLogger(name).addFilter(_OneLineRecords())
        try:
            return typer.main.get_command(self)(*args, **kwargs)
        except Exception as e:  # everything not already a clean exit (click handles its own errors)
            message = str(e).strip().splitlines()[0] if str(e).strip() else ""
            typer.secho(
                f"error: {type(e).__name__}: {message} (arpo --debug ... shows the traceback)",
                fg=typer.colors.RED,
                err=True,
            )
            sys.exit(1)


app = OneLineErrors(add_completion=False, no_args_is_help=True, help="ARPO training pipeline for GUI agents.")


@app.callback()
def _main(
    debug: bool = typer.Option(
        False, "--debug", help=f"show tracebacks (also {DEBUG_ENV}=1); errors are one line otherwise"
    ),
) -> None:
    """ARPO training pipeline for GUI agents."""


PARAMS_OPT = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")
SET_OPT = typer.Option([], "--set", "-S", help="override, e.g. train.replay.enabled=false (repeatable)")
PRESET_OPT = typer.Option(None, "--preset", help="partial params file merged over --params, e.g. quick")

STAGE_HELP = " | ".join(STAGE_NAMES)
TARGET_OPT = typer.Option(
    [], "--target", "-t", help=f"run only this stage and the stages it needs (repeatable): {STAGE_HELP}"
)
METRIC_OPT = typer.Option([], "--metric", "-m", help="metric column (repeatable)")
VIEW_PATHS_ARG = typer.Argument(..., help="trajectory Parquet files or directories of them")
PARAMS_OUT_OPT = typer.Option(None, "--out", "-o", help="write the merged params to this file")
SNAPSHOT_OUT_OPT = typer.Option(..., "--out", "-o", help="the directory to write (absent or empty)")
STUDY_OUT_OPT = typer.Option(
    None,
    "--out",
    "-o",
    help="JSON to write (default benchmarks/results/replay_effect.json; for a suite of pinned instances "
    "replay_<preset>.json when the preset is named replay-<x>, else replay_instances.json)",
)
DVC_OUT_OPT = typer.Option(Path("dvc.yaml"), "--out", "-o", help="file to write")
DVC_CHECK_OPT = typer.Option(False, "--check", help="only check that the file equals the stage table's")
VIEW_OUT_OPT = typer.Option(Path("plots/viewer/view.html"), "--out", "-o", help="HTML page to write")


@contextlib.contextmanager
def _locked(command: str) -> Iterator[None]:
    """The working tree's run lock (arpo_core/infra/lock.py) around a run; held: exit 3 naming the holder.
    Nothing the run starts outlives it (arpo_core/infra/guardian.py): SIGTERM/SIGHUP end it through the
    normal exit path, Prefect's temporary server and Ray are stopped on the way out (flows/services.py),
    and a guardian process removes whatever child is left once the run has gone (also after a
    SIGKILL). Ctrl-C ends it with exit 130, after its runs are marked."""
    from arpo_core.infra.guardian import start_guardian
    from arpo_core.infra.lock import RunLocked
    from flows.services import INTERRUPTED, on_interrupt, run_lock, stop_services

    try:
        with run_lock(".", command=command):
            _guardians.append(start_guardian())
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, _exit_on_signal)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored (nohup)
                INTERRUPTED.clear()
                signal.signal(signal.SIGINT, on_interrupt)
            try:
                yield
            finally:
                stop_services()
    except RunLocked as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from e
    except KeyboardInterrupt:
        # Ctrl-C: the runs are marked and the services stopped by now; exit as a shell's job does (130),
        # with one line instead of click's "Aborted!" and exit 1.
        typer.secho(f"[arpo] {command}: interrupted", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(128 + signal.SIGINT) from None


_guardians: list = []


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _load(params: Path, overrides: list[str], preset: str | None = None) -> Params:
    try:
        return load_params(params, overrides, preset=preset)
    except ConfigError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from e


@app.command()
def params(
    params: Path = PARAMS_OPT,
    set_: list[str] = SET_OPT,
    preset: str = PRESET_OPT,
    as_json: bool = False,
    out: Path = PARAMS_OUT_OPT,
) -> None:
    """Validate the params file (with preset and overrides) and print the effective configuration, or
    write it to --out (read first, then written atomically: `--out params.yaml` is safe)."""
    cfg = to_dict(_load(params, set_, preset))
    text = json.dumps(cfg, indent=2) if as_json else yaml.safe_dump(cfg, sort_keys=False).rstrip()
    if out is None:
        typer.echo(text)
        return
    from arpo_core.infra.fileio import atomic_write_text

    atomic_write_text(out, text + "\n")
    typer.echo(f"wrote {out}")


def _known_stage(name: str) -> None:
    """A stage name from the command line that the stage table lacks is a one-line usage error."""
    if name not in STAGE_NAMES:
        raise typer.BadParameter(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")


def run_stage(
    name: str,
    params: Path = Path("params.yaml"),
    overrides: list[str] | None = None,
    preset: str | None = None,
) -> dict[str, float]:
    """Run one stage outside Prefect (what `arpo stage` and so each DVC stage does), tracked in MLflow
    like the stage's flow: the flow's own function, whose task calls then run as plain functions."""
    _known_stage(name)
    from flows.stage_flows import FLOWS

    return FLOWS[name].fn(params=str(params), preset=preset, overrides=list(overrides or ()))


@app.command()
def stage(
    name: str = typer.Argument(..., help=STAGE_HELP),
    params: Path = PARAMS_OPT,
    set_: list[str] = SET_OPT,
    preset: str = PRESET_OPT,
    force: bool = typer.Option(False, "--force", help="run it even if its stamp says it is up to date"),
    nproc_per_node: int = typer.Option(
        0,
        "--nproc-per-node",
        help="train on this many data-parallel ranks on this machine (torchrun's launcher in-process); "
        "0: one process, or the ranks torchrun / deepspeed started this process among",
    ),
) -> None:
    """Run one pipeline stage without Prefect (each DVC stage's cmd), tracked in MLflow; a stage whose
    stamp matches its params, inputs, code and outputs is skipped, as `arpo run` skips it
    (flows/spec.py, decision "One staleness authority"), so `dvc repro` after an `arpo run` only records what
    is there.

    Data-parallel training (docs/scale-out.md): `torchrun --nproc-per-node N .venv/bin/arpo stage train`
    (or `--nnodes`, or the deepspeed launcher), or `arpo stage train --nproc-per-node N`. Rank 0 is the
    tracked run (lock, MLflow, stamp, outputs); the other ranks only train."""
    from flows.spec import SPECS, is_up_to_date

    _known_stage(name)
    p = _load(params, set_, preset)  # a bad key exits 2 with the message, before any work
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (world > 1 or nproc_per_node > 1) and name != "train":
        _fail(f"only the train stage runs on several ranks, not {name!r}")
    if nproc_per_node > 1 and world == 1:
        _launch_ranks(nproc_per_node, params, set_, preset, force)
        return
    if int(os.environ.get("RANK", "0")) != 0:  # a rank of a launched job: no lock, no tracking
        if force or not is_up_to_date(p, SPECS[name], Path(".")):
            _run_rank(name, p)
        return
    with _locked(f"arpo stage {name}"):
        if not force and is_up_to_date(p, SPECS[name], Path(".")):
            typer.echo(f"{name}: up to date, skipped (its stamp matches; --force runs it)")
            return
        metrics = run_stage(name, params, set_, preset)
    typer.echo(json.dumps(metrics, indent=1, sort_keys=True))


@app.command()
def snapshot(
    name: str = typer.Argument(..., help=STAGE_HELP),
    out: Path = SNAPSHOT_OUT_OPT,
    params: Path = PARAMS_OPT,
    set_: list[str] = SET_OPT,
    preset: str = PRESET_OPT,
) -> None:
    """Write what a running or interrupted stage has so far as a usable output at --out, without stopping
    or touching it: for `ground`, the latest phase checkpoint's weights as a policy directory with their
    curves (arpo_core/pipeline/ground.py, decision "Snapshots"), which `-S ground.checkpoint=DIR` can then
    start the main job from. Give the run's preset and overrides: the checkpoint must have been made by
    them. Run it in the project folder of the run; it takes no lock and writes nothing there."""
    from flows.runner import staging_path
    from flows.spec import SPECS

    _known_stage(name)
    spec = SPECS[name]
    if spec.snapshot is None:
        have = ", ".join(n for n, s in SPECS.items() if s.snapshot is not None)
        _fail(f"the {name} stage keeps nothing to snapshot while it runs (stages that do: {have})")
    p = _load(params, set_, preset)
    kwargs = {k: staging_path(v) if k in spec.outputs else v for k, v in spec.kwargs(Path(".")).items()}
    try:
        info = spec.snapshot(p, dest=out, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    typer.echo(json.dumps(info, indent=1, sort_keys=True))


def _fail(message: str, code: int = 1) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _run_rank(name: str, p: Params) -> None:
    """A rank other than 0 of a launched training job: the stage's code on the same (staging) paths as
    rank 0's tracked run, which owns the lock, MLflow, the stamp and the output swap."""
    from arpo_core.pipeline.table import stage as stage_of
    from flows.runner import staging_path

    s = stage_of(name)
    outputs = {k: staging_path(Path(v)) for k, v in s.outputs.items()}
    s.run(p, **(s.kwargs(Path(".")) | outputs))


def _launch_ranks(n: int, params: Path, set_: list[str], preset: str | None, force: bool) -> None:
    """`arpo stage train --nproc-per-node N`: torch's elastic launcher (what torchrun runs) starts N
    copies of `arpo stage train` on this machine under this command's run lock. A rank that dies ends the
    job at once (the launcher stops the others; a hung rank ends at `train.distributed.timeout_s`), and
    the error names the rank, how it ended and its last step from the ranks' heartbeats
    (distributed.py, decision "Rank heartbeats"). Run the same command again to resume, with any number of
    ranks."""
    from arpo_core.algorithm.distributed import launch_ranks
    from arpo_core.algorithm.engines import free_port
    from arpo_core.pipeline.table import stage as stage_of
    from flows.runner import staging_path

    args = [str(Path(sys.argv[0]).resolve()), "stage", "train", "--params", str(params)]
    args += [a for kv in set_ for a in ("-S", kv)] + (["--preset", preset] if preset else [])
    args += ["--force"] if force else []
    beats = staging_path(Path(stage_of("train").outputs["out_dir"])) / "ranks"
    with _locked(f"arpo stage train --nproc-per-node {n}"):
        failure = launch_ranks(n, args, beats, free_port())
    if failure is not None:
        _fail(
            f"training on {n} ranks failed: {failure}. The same command resumes from the last epoch "
            "checkpoint (with any number of ranks)."
        )


@app.command("dvc-yaml")
def dvc_yaml(
    out: Path = DVC_OUT_OPT,
    check: bool = DVC_CHECK_OPT,
) -> None:
    """Write dvc.yaml from the stage table (arpo_core/pipeline/table.py), or check it is current."""
    from flows.spec import dvc_yaml as render

    text = render()
    if check:
        if not out.exists() or out.read_text() != text:
            typer.secho(
                f"error: {out} differs from the stage table; run `arpo dvc-yaml`",
                fg=typer.colors.RED,
                err=True,
            )
            raise typer.Exit(1)
        typer.echo(f"{out} is current")
        return
    out.write_text(text)
    typer.echo(f"wrote {out} ({len(STAGE_NAMES)} stages)")


@app.command()
def run(
    params: Path = PARAMS_OPT,
    set_: list[str] = SET_OPT,
    preset: str = PRESET_OPT,
    force: bool = typer.Option(False, "--force", help="re-run stages that are up to date"),
    target: list[str] = TARGET_OPT,
) -> None:
    """Run the pipeline (the Prefect flow `arpo-train`) here, skipping up-to-date stages; with --target,
    only that stage and its upstream stages (like `dvc repro TARGET`). Without a Prefect server
    configured (PREFECT_API_URL) Prefect starts a temporary local one for the run."""
    _load(params, set_, preset)
    for t in target:
        _known_stage(t)
    from flows.arpo_train import arpo_train
    from flows.runner import FRONT_DOOR_ENV

    t0 = time.monotonic()
    with _locked("arpo run " + " ".join(sys.argv[2:])):
        from flows.services import own_session_server

        # services.py, decision "Prefect server session": Ctrl-C must not reach the temporary server
        own_session_server()
        os.environ[FRONT_DOOR_ENV] = "arpo run"
        arpo_train(
            params=str(params), preset=preset, overrides=list(set_), force=force, targets=list(target) or None
        )
    typer.secho(f"[arpo] pipeline finished in {(time.monotonic() - t0) / 60:.1f} min", fg=typer.colors.GREEN)


@app.command()
def lock() -> None:
    """Say whether a run could start in this working tree: exit 0 when free, 3 naming the live `arpo`
    run or DVC command that holds it (`make repro` asks before `dvc repro`; arpo_core/infra/lock.py)."""
    from arpo_core.infra.lock import probe

    busy = probe(".")
    if busy is not None:
        typer.secho(f"error: {busy}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3)
    typer.echo("no run holds this working tree")


@app.command()
def runs(
    experiment: str = typer.Option(None, "--experiment", "-e", help="default: project.name of --params"),
    stage_name: str = typer.Option(
        None, "--stage", "-s", help="only runs of this stage, e.g. evaluate; `pipeline`: the parent runs"
    ),
    metric: list[str] = METRIC_OPT,
    params: Path = PARAMS_OPT,
    limit: int = typer.Option(30, help="newest N runs"),
) -> None:
    """Compare the MLflow runs of an experiment in a terminal table: one row per run (the pipeline
    runs, named by variant, with `-s pipeline`), the params that differ between runs of the same
    stage (what each variant changed), then the metric columns."""
    from tracking import mlflow_runs

    name = experiment or _load(params, []).project.name
    rows = mlflow_runs.run_rows(mlflow_runs.client(), name, stage_name)[:limit]
    if not rows:
        typer.echo(f"no runs in experiment {name!r} ({mlflow_runs.tracking_uri()})")
        raise typer.Exit(1)
    columns = list(metric) or mlflow_runs.default_columns(rows)
    typer.echo(mlflow_runs.comparison_table(rows, columns, mlflow_runs.differing_params(rows)))


@app.command()
def study(
    out: Path = STUDY_OUT_OPT,
    experiment: str = typer.Option(None, "--experiment", "-e", help="default: project.name of --params"),
    variant: str = typer.Option(None, "--variant", help="only train runs whose variant contains this"),
    hard_max: float = typer.Option(0.25, help="hard task = sampled base success <= this"),
    reps: int = typer.Option(2000, help="bootstrap replicates"),
    alignment: bool = typer.Option(True, help="click alignment from DOM targets (starts one browser)"),
    params: Path = PARAMS_OPT,
    preset: str = PRESET_OPT,
) -> None:
    """Replay study result files (ARPO vs GRPO over seeds) from the MLflow runs of the study's train
    stages (each with evaluate.during_training > 0): replay_effect.json, .md and a plot; for a suite of
    pinned instances (e.g. --preset replay-instances, the paper's protocol) replay_instances.json, .md
    and a plot, from the runs of that suite only."""
    from arpo_core.config import flatten, to_dict
    from arpo_core.config.suites import load_suite
    from tracking.study_runs import instance_study, replay_study, study_base

    p = _load(params, [], preset)
    base = study_base(flatten(to_dict(p)))  # study_runs.py, decision "One base per study"
    if any(t.pinned for t in load_suite(p.env.in_domain_suite)):
        name = (preset or "replay-instances").replace("-", "_")  # replay-rare -> replay_rare.json
        out = out or Path(
            f"benchmarks/results/{name if name.startswith('replay_') else 'replay_instances'}.json"
        )
        try:
            doc = instance_study(
                experiment or p.project.name, out, p.env.in_domain_suite, variant, reps, base=base
            )
        except FileNotFoundError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from e
        for key in ("train", "heldout"):
            d = doc["arpo_minus_grpo"][key]
            typer.echo(f"{out}: arpo - grpo ({key}) = {d['mean']} {d['ci95']}; arms {sorted(doc['arms'])}")
        return
    out = out or Path("benchmarks/results/replay_effect.json")
    targets: list = []
    if alignment:
        from arpo_core.pipeline.common import suite_tasks
        from arpo_core.pipeline.compare import first_click_targets

        targets, _ = first_click_targets(p, suite_tasks(p, "in_domain"), p.evaluate.during_training_episodes)
    try:
        doc = replay_study(
            experiment or p.project.name,
            out,
            variant,
            hard_max,
            reps,
            targets,
            first_seed=p.evaluate.seed,
            base=base,
        )
    except FileNotFoundError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from e
    d = doc["arpo_minus_grpo"]["hard"]
    typer.echo(f"{out}: arpo - grpo (hard) = {d['mean']} {d['ci95']}; arms {sorted(doc['arms'])}")


@app.command()
def view(
    paths: list[Path] = VIEW_PATHS_ARG,
    out: Path = VIEW_OUT_OPT,
    title: str = typer.Option("", help="page title (default: what it shows, e.g. '12 train episodes (...)')"),
    task: str = typer.Option(None, help="only episodes of this task id"),
    limit: int = typer.Option(0, help="at most N episodes (0 = all)"),
) -> None:
    """Write a self-contained HTML page showing each episode step by step (screenshot with the click,
    thought, action, reward, replayed flag; filters by task, success and epoch)."""
    from arpo_core.analysis.viewer import describe_episodes, write_viewer
    from arpo_core.trajectory import read_trajectories

    trajs, sources = [], []
    files = [f for path in paths for f in (sorted(path.glob("*.parquet")) if path.is_dir() else [path])]
    for path in files:
        try:
            got = read_trajectories(path)
            trajs += got
            # each episode labelled with its file (viewer.py, decision "Episode provenance")
            sources += [str(path)] * len(got)
        except (FileNotFoundError, ValueError) as e:
            typer.secho(f"error: {path}: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from e
    if task:
        keep = [i for i, t in enumerate(trajs) if t.task_id == task]
        trajs, sources = [trajs[i] for i in keep], [sources[i] for i in keep]
    if limit:
        trajs, sources = trajs[:limit], sources[:limit]
    if not trajs:
        typer.secho("error: no episodes to show", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    page = write_viewer(trajs, out, title=title or describe_episodes(trajs, sources), sources=sources)
    typer.echo(f"{page} ({len(trajs)} episodes)")


if __name__ == "__main__":
    app()
