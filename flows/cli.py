"""The `arpo` command: the front door of the pipeline (it may import Prefect; arpo_core may not)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
import yaml

from arpo_core.config import ConfigError, Params, load_params, to_dict

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ARPO training pipeline for GUI agents.")

PARAMS_OPT = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")
SET_OPT = typer.Option([], "--set", "-S", help="override, e.g. train.replay.enabled=false (repeatable)")
PRESET_OPT = typer.Option(None, "--preset", help="partial params file merged over --params, e.g. quick")

# Default locations of every stage's outputs (the same paths as dvc.yaml).
PATHS = {
    "init_policy": Path("models/init"),
    "demos": Path("data/demos/demos.parquet"),
    "sft": Path("models/base"),
    "baseline": Path("data/baseline"),
    "select": Path("data/selected_tasks.json"),
    "train": Path("models/arpo"),
    "evaluate": Path("data/eval"),
    "metrics": Path("metrics/evaluate.json"),
}
STAGE_NAMES = ("init_policy", "demos", "sft", "baseline", "select", "train", "evaluate")


def _load(params: Path, overrides: list[str], preset: str | None = None) -> Params:
    try:
        return load_params(params, overrides, preset=preset)
    except ConfigError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from e


@app.command()
def params(
    params: Path = PARAMS_OPT, set_: list[str] = SET_OPT, preset: str = PRESET_OPT, as_json: bool = False
) -> None:
    """Validate the params file (with preset and overrides) and print the effective configuration."""
    cfg = to_dict(_load(params, set_, preset))
    typer.echo(json.dumps(cfg, indent=2) if as_json else yaml.safe_dump(cfg, sort_keys=False).rstrip())


def run_stage(name: str, p: Params, root: Path = Path(".")) -> dict:
    """Run one stage with the default paths under `root`; returns its metrics."""
    from arpo_core import stages

    P = {k: root / v for k, v in PATHS.items()}
    if name == "init_policy":
        return stages.init_policy(p, P["init_policy"])
    if name == "demos":
        return stages.demos(p, P["demos"])
    if name == "sft":
        return stages.sft_stage(p, P["init_policy"], P["demos"], P["sft"])
    if name == "baseline":
        return stages.baseline(p, P["sft"], P["baseline"])
    if name == "select":
        return stages.select(p, P["baseline"], P["select"])
    if name == "train":
        return stages.train_stage(p, P["sft"], P["select"], P["train"])
    if name == "evaluate":
        policies = {"base": P["sft"], "arpo": P["train"] / "policy"}
        return stages.evaluate(p, policies, P["evaluate"], P["metrics"])
    raise typer.BadParameter(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")


@app.command()
def stage(
    name: str = typer.Argument(..., help="init_policy | demos | sft | baseline | select | train | evaluate"),
    params: Path = PARAMS_OPT,
    set_: list[str] = SET_OPT,
    preset: str = PRESET_OPT,
) -> None:
    """Run one pipeline stage (what a DVC stage and a Prefect flow call)."""
    p = _load(params, set_, preset)
    t0 = time.monotonic()
    metrics = run_stage(name, p)
    typer.echo(json.dumps({**metrics, f"time/{name}_s": time.monotonic() - t0}, indent=1, sort_keys=True))


@app.command()
def run(params: Path = PARAMS_OPT, set_: list[str] = SET_OPT, preset: str = PRESET_OPT) -> None:
    """Run the pipeline on the embedded default, stage after stage (the stages that exist so far)."""
    p = _load(params, set_, preset)
    typer.echo(f"[arpo] params OK: project {p.project.name!r}, seed {p.project.seed}")
    for name in STAGE_NAMES:
        t0 = time.monotonic()
        typer.secho(f"[arpo] stage {name} ...", fg=typer.colors.CYAN)
        metrics = run_stage(name, p)
        shown = ", ".join(f"{k}={v:.3g}" for k, v in sorted(metrics.items()) if isinstance(v, float))
        typer.echo(f"[arpo] stage {name} done in {time.monotonic() - t0:.0f} s: {shown}")


if __name__ == "__main__":
    app()
