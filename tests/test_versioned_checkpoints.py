"""The versioned grounded checkpoints in assets/checkpoints: each trained by the `ground` stage carries the
report that stage wrote (its recipe, the commit that trained it, its curves and final measures), the recipe
is what its preset gives, the README's table is the report's measures, and the main job's default start
is one of them."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from arpo_core.config import GroundPhase, GroundSectionConfig, load_params
from arpo_core.pipeline import ground
from arpo_core.pipeline.ground import GROUND_REPORT
from arpo_core.policy.model import count_parameters, load_policy

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets" / "checkpoints"
RECIPES = {"grounded-read-xs": "ground-reading-place"}
"""Each checkpoint that the `ground` stage trained -> the preset that re-runs it (`arpo stage ground --preset
NAME`). grounded-xs predates the stage's report: its recipe is presets/ground-recipe.yaml, its runs'
commands are in benchmarks/results/grounding.json."""


def _report(name: str) -> dict:
    return json.loads((ASSETS / name / GROUND_REPORT).read_text())


def test_every_checkpoint_with_a_report_has_its_recipe_named_here():
    reported = sorted(d.name for d in ASSETS.iterdir() if (d / GROUND_REPORT).exists())
    assert reported == sorted(RECIPES), (
        "a versioned checkpoint without its preset, or a preset's checkpoint gone"
    )


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_versioned_checkpoint_carries_the_recipe_its_preset_reruns(name):
    report = _report(name)
    section = load_params(ROOT / "params.yaml", preset=RECIPES[name]).ground
    want = dataclasses.asdict(section)
    default = dataclasses.asdict(GroundPhase())
    for got, phase in zip(report["config"]["phases"], want["phases"], strict=True):
        for field in set(phase) - set(got):  # a phase field added after the checkpoint was made
            assert phase[field] == default[field], (field, phase[field])  # at its default: the same recipe
            del phase[field]
    section_default = dataclasses.asdict(GroundSectionConfig())
    for field in set(want) - set(report["config"]):  # a section field added after the checkpoint was made
        assert want[field] == section_default[field], (field, want[field])  # at its default: the same recipe
        del want[field]
    assert report["config"] == want  # the whole ground section, as the stage writes it
    assert report["start"] == section.checkpoint and (ROOT / section.checkpoint / "config.json").exists()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_versioned_checkpoint_names_a_clean_commit_of_this_history(name):
    code = _report(name)["code"]
    assert code is not None and not code["dirty"], code
    known = subprocess.run(
        ["git", "cat-file", "-t", code["commit"]], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    if known.returncode != 0 and (ROOT / ".git" / "shallow").exists():
        pytest.skip(f"a shallow clone: commit {code['commit']} is not in it")  # CI clones in full
    assert known.stdout.strip() == "commit", known.stderr


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_versioned_checkpoint_carries_its_curves_and_loads(name):
    report = _report(name)
    phases = report["phases"]
    assert len(phases) == len(report["config"]["phases"])
    for ph, cfg in zip(phases, report["config"]["phases"], strict=True):
        assert 0 < ph["steps"] <= cfg["steps"]
        assert len(ph["curve"]) >= 2 and all("hit_rate" in ev for ev in ph["curve"])
    policy = load_policy(ASSETS / name)  # a stock Qwen2.5-VL checkpoint: the probe and heads were dropped
    assert count_parameters(policy.model) == _readme_parameters(name)


def _section(name: str) -> str:
    """The README's paragraphs on `name`: from its `NAME/`: heading to the next checkpoint's."""
    text = (ASSETS / "README.md").read_text()
    block = text[text.index(f"\n`{name}/`:") + 1 :]
    after = re.search(r"^`[\w-]+/`:", block[1:], re.M)
    return block[: after.start() + 1] if after else block


def _readme_parameters(name: str) -> int:
    """The parameter count the README gives for `name`."""
    return int(re.search(r"\(([\d,]+) parameters", _section(name)).group(1).replace(",", ""))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_readme_table_is_the_reports_measures(name):
    """Every `| screens | hit (blind) | corr x / y |` row under the checkpoint's README heading is a set of
    its report's final measures, to the digit shown."""
    measures = _report(name)["measures"]
    block = _section(name)
    rows = re.findall(r"^\| `(\w+)` [^|]*\| ([\d.]+) \(([\d.]+)\) \| ([-\d.]+) / ([-\d.]+) \|$", block, re.M)
    assert {r[0] for r in rows} == set(measures), rows
    for key, hit, blind, cx, cy in rows:
        m = measures[key]
        shown = (hit, blind, cx, cy)
        assert shown == tuple(f"{m[k]:.2f}" for k in ("hit_rate", "blind_hit_rate", "corr_x", "corr_y")), key


def test_the_main_job_starts_from_a_versioned_reader():
    default = load_params(ROOT / "params.yaml").ground.checkpoint
    assert default is not None and Path(default).name in RECIPES


def test_the_ground_stage_keeps_a_versioned_starts_report(tmp_path):
    """The main job's `ground` copies the versioned start and measures it; its report keeps the start's
    whole report (recipe, commit, curves) as `start_report`, so models/grounded says how it was made."""
    name = sorted(RECIPES)[0]
    over = [f"ground.checkpoint={ASSETS / name}", "ground.phases=[]", "ground.eval_levels=[box1h]"]
    over += ["ground.eval_per_level=4", "ground.eval_miniwob_seeds=0"]
    (tmp_path / "init").mkdir()
    ground.run(load_params(ROOT / "params.yaml", over), tmp_path / "init", tmp_path / "g")
    report = json.loads((tmp_path / "g" / GROUND_REPORT).read_text())
    assert report["start"] == str(ASSETS / name) and report["start_report"] == _report(name)
    assert set(report["measures"]) == {"box1h"}
    assert (tmp_path / "g" / "model.safetensors").read_bytes() == (
        ASSETS / name / "model.safetensors"
    ).read_bytes()
