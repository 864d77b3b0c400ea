"""The `arpo` command: params validation and overrides through the real console entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_params_prints_effective_config_with_overrides():
    res = runner.invoke(
        app, ["params", "-p", str(ROOT / "params.yaml"), "--set", "train.replay.enabled=false"]
    )
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.output)
    assert cfg["train"]["replay"]["enabled"] is False
    assert cfg["train"]["loss"]["clip_high"] == 0.3


def test_unknown_key_exits_2_with_message(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  epochz: 3\n")
    res = runner.invoke(app, ["params", "-p", str(bad)])
    assert res.exit_code == 2
    assert "unknown key 'epochz' in section 'train'" in res.output
    assert str(bad) in res.output


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "arpo"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0
    assert "params" in out.stdout and "run" in out.stdout


def test_stage_rejects_unknown_stage_name():
    res = runner.invoke(app, ["stage", "trian", "-p", str(ROOT / "params.yaml")])
    assert res.exit_code != 0
    assert "unknown stage 'trian'" in res.output and "init_policy" in res.output


def test_run_fails_on_bad_override_before_starting_prefect():
    res = runner.invoke(app, ["run", "-p", str(ROOT / "params.yaml"), "-S", "train.epochz=1"])
    assert res.exit_code == 2
    assert "unknown key 'epochz' in section 'train'" in res.output


def test_help_lists_orchestration_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("params", "stage", "run", "runs"):
        assert cmd in res.output
    assert "--force" in runner.invoke(app, ["run", "--help"]).output


def test_params_out_writes_the_merged_file_over_its_own_input(tmp_path):
    """`arpo params --preset quick --out params.yaml` reads params.yaml before replacing it (a shell
    redirect would empty it first)."""
    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "params.yaml"
    target.write_text((root / "params.yaml").read_text())
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "quick.yaml").write_text((root / "presets" / "quick.yaml").read_text())
    res = runner.invoke(app, ["params", "-p", str(target), "--preset", "quick", "--out", str(target)])
    assert res.exit_code == 0, res.output
    written = yaml.safe_load(target.read_text())
    assert written["train"]["epochs"] == 1 and written["env"]["n_envs"] == 2  # the quick preset's values
    assert written["train"]["loss"]["clip_high"] == 0.3  # and params.yaml's
