"""The `arpo` command: the front door of the pipeline (it may import Prefect; arpo_core may not)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
import yaml

from arpo_core.config import ConfigError, load_params, to_dict

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ARPO training pipeline for GUI agents.")

PARAMS_OPT = typer.Option(Path("params.yaml"), "--params", "-p", help="params file")
SET_OPT = typer.Option([], "--set", "-S", help="override, e.g. train.replay.enabled=false (repeatable)")


def _load(params: Path, overrides: list[str]):
    try:
        return load_params(params, overrides)
    except ConfigError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from e


@app.command()
def params(params: Path = PARAMS_OPT, set_: list[str] = SET_OPT, as_json: bool = False) -> None:
    """Validate the params file (with overrides) and print the effective configuration."""
    cfg = to_dict(_load(params, set_))
    typer.echo(json.dumps(cfg, indent=2) if as_json else yaml.safe_dump(cfg, sort_keys=False).rstrip())


@app.command()
def run(params: Path = PARAMS_OPT, set_: list[str] = SET_OPT) -> None:
    """Run the pipeline on the embedded default (the stages that exist so far)."""
    cfg = _load(params, set_)
    typer.echo(f"[arpo] params OK: project {cfg.project.name!r}, seed {cfg.project.seed}")


if __name__ == "__main__":
    app()
