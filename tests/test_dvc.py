"""dvc.yaml against params.yaml, the config dataclasses and flows/spec.py. Real `dvc repro` / `dvc exp
run` on a pipeline's outputs: tests/test_flows.py (one quick run serves the Prefect, MLflow and DVC
checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from arpo_core.config import ConfigError, load_params, parse_params, to_dict
from arpo_core.pipeline.table import import_closure
from flows.cli import app
from flows.spec import SPECS, STAGE_NAMES, dvc_yaml

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())


def _paths(entries: list) -> list[str]:
    """The paths of a stage's outs / metrics / plots, each written `{path: {persist: true}}`."""
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries]


def test_every_output_persists_so_a_failed_stage_keeps_the_last_good_one():
    """DVC deletes a stage's outputs before running it unless they persist; the runner swaps them in
    itself once the stage succeeded (runner.py, decision "Staged outputs"), so every out, metric and plot
    persists."""
    for name, stage in DVC["stages"].items():
        for key in ("outs", "metrics", "plots"):
            for entry in stage.get(key, []):
                assert isinstance(entry, dict) and next(iter(entry.values())) == {"persist": True}, (
                    name,
                    entry,
                )


RAW_PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def _lookup(tree, dotted):
    node = tree
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"params key '{dotted}' missing at '{part}'"
        node = node[part]
    return node


def test_dvc_yaml_is_the_stage_table():
    """dvc.yaml is generated from the stage table (flows/spec.py, decision "Stage table"): the committed file
    must equal the generation, so DVC and `arpo run` re-run a stage for the same reasons."""
    assert (ROOT / "dvc.yaml").read_text() == dvc_yaml(), "dvc.yaml is stale: run `arpo dvc-yaml`"
    assert tuple(DVC["stages"]) == STAGE_NAMES
    res = CliRunner().invoke(app, ["dvc-yaml", "--check", "--out", str(ROOT / "dvc.yaml")])
    assert res.exit_code == 0, res.output


def test_dvc_yaml_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "dvc.yaml"
    stale.write_text((ROOT / "dvc.yaml").read_text().replace("arpo_core/rewards.py", "arpo_core/nothing.py"))
    res = CliRunner().invoke(app, ["dvc-yaml", "--check", "--out", str(stale)])
    assert res.exit_code == 1 and "differs from the stage table" in res.output


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_stage_deps_cover_every_project_module_it_imports(name):
    """stage.py, decision "Derived code deps": every arpo_core file the stage's module reaches through imports
    (any depth, function-level too) is a dep, itself or through its directory; every dep exists or is an
    output."""
    spec = SPECS[name]
    reached = import_closure(spec.module)
    for f in reached:
        assert any(f == d or f.startswith(d + "/") for d in spec.deps), f"{name}: {f} not in deps"
    outs = {o for s in SPECS.values() for o in s.outs}
    for dep in spec.deps:
        assert (ROOT / dep).exists() or dep in outs, dep
    assert spec.metrics == f"metrics/{name}.json"


def test_rollout_stages_depend_on_the_reward_code():
    """The issue that motivated derived deps: rewards.py was imported by rollout but in no stage's deps."""
    for name in ("baseline", "train", "evaluate", "rft", "compare"):
        assert "arpo_core/rewards.py" in SPECS[name].deps, name


def test_import_closure_follows_function_level_imports(tmp_path):
    pkg = tmp_path / "arpo_core"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from arpo_core.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import arpo_core.c\n")
    (pkg / "c.py").write_text("import os\n")
    (pkg / "unused.py").write_text("")
    got = import_closure("arpo_core.a", tmp_path)
    assert got == (
        "arpo_core/__init__.py",
        "arpo_core/a.py",
        "arpo_core/c.py",
        "arpo_core/sub/__init__.py",
        "arpo_core/sub/b.py",
    )


@pytest.mark.parametrize("key", sorted({k for s in DVC["stages"].values() for k in s["params"]}))
def test_every_dvc_params_key_exists_in_params_yaml_and_parses(key):
    raw = _lookup(RAW_PARAMS, key)
    parsed = _lookup(to_dict(parse_params(RAW_PARAMS, "params.yaml")), key)
    if isinstance(raw, dict):
        assert set(raw) <= set(parsed)
    else:
        assert parsed == raw


def test_every_stage_reads_its_own_params_section():
    for name, stage in DVC["stages"].items():
        assert name in stage["params"], name


def test_dvc_plots_are_images_a_stage_writes():
    """`dvc plots show` must render offline: only image plots (no data series, whose page loads Vega
    from a CDN), each one written by a stage; the epoch panels draw columns the train stage writes."""
    from flows.runner import PLOT_COLUMNS
    from flows.spec import EPOCH_PANELS

    plots = list(DVC["plots"]) + [p for s in DVC["stages"].values() for p in _paths(s.get("plots", []))]
    assert plots == ["reports/comparison/comparison.png", "plots/train_epochs.png"]
    outs = [o for s in DVC["stages"].values() for o in _paths(s["outs"])]
    for plot in plots:
        assert isinstance(plot, str) and plot.endswith(".png")
        assert plot in _paths(DVC["stages"]["train"].get("plots", [])) or any(
            plot.startswith(o + "/") for o in outs
        )
    assert {k for keys in EPOCH_PANELS.values() for k in keys} <= set(PLOT_COLUMNS)


def test_metrics_files_are_summaries_and_details_are_plain_outputs():
    """`dvc metrics show` reads metrics/<stage>.json only; the breakdowns file of each stage is an
    output DVC tracks but does not show as metrics (spec.py, decision "Short metrics files")."""
    for name, stage in DVC["stages"].items():
        assert _paths(stage["metrics"]) == [f"metrics/{name}.json"]
        assert f"metrics/details/{name}.json" in _paths(stage["outs"])


def test_unknown_key_in_params_yaml_fails_with_a_clear_message(tmp_path):
    bad = tmp_path / "params.yaml"
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"]["replay"]["enabeld"] = False
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"unknown key 'enabeld' in section 'train\.replay'"):
        load_params(bad)
    # what a DVC stage's command does with it: exit 2 before any work, naming key, section and file
    res = CliRunner().invoke(app, ["stage", "select", "-p", str(bad)])
    assert res.exit_code == 2
    assert "unknown key 'enabeld' in section 'train.replay'" in res.output and str(bad) in res.output


def test_dvc_config_is_local_without_analytics():
    text = (ROOT / ".dvc" / "config").read_text()
    assert "analytics = false" in text and "url = ../dvc-remote" in text
    assert "/dvc-remote/" in (ROOT / ".gitignore").read_text()
    assert "__pycache__" in (ROOT / ".dvcignore").read_text()


# Real DVC on a pipeline's outputs: tests/test_flows.py, test_quick_pipeline_through_a_prefect_deployment_
# then_dvc_on_the_same_outputs (`dvc repro` after a deployment run, again, `dvc exp run -S`, metrics,
# plots, push), on the same run as the Prefect and MLflow checks (issue 30 item 6).
