"""Bad input gives one clear line (issue 17 item 3), through the real `arpo` console script: YAML syntax
errors with file:line:column, an empty params file, a suite naming a task that does not exist (with the
closest names), an override error naming the override, an unknown preset listing the presets, and any
unexpected exception as one line unless `arpo --debug`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arpo_core.config import ConfigError, load_params
from arpo_core.config.check import miniwob_task_names, unknown_suite_task

ROOT = Path(__file__).resolve().parents[1]
ARPO = Path(sys.executable).parent / "arpo"


def arpo(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(ARPO), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def one_line(res: subprocess.CompletedProcess) -> str:
    """The whole stderr, asserted to be a single `error: ...` line."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in res.stderr
    return lines[0]


def _bad_suite(tmp_path: Path) -> Path:
    text = (ROOT / "data/suites/miniwob_in_domain.yaml").read_text()
    assert "\n  - click-button\n" in text
    suite = tmp_path / "suite.yaml"
    suite.write_text(text.replace("\n  - click-button\n", "\n  - click-buton\n"))
    return suite


def test_suite_naming_an_unknown_task_fails_when_params_load(tmp_path):
    suite = _bad_suite(tmp_path)
    line_no = next(i for i, ln in enumerate(suite.read_text().splitlines(), 1) if "click-buton" in ln)
    with pytest.raises(ConfigError) as e:
        load_params(ROOT / "params.yaml", [f"env.in_domain_suite={suite}"])
    msg = str(e.value)
    assert f"'click-buton' ({suite}:{line_no})" in msg
    assert "closest known: click-button" in msg and "env.in_domain_suite" in msg
    assert f"-S env.in_domain_suite={suite}" in msg  # where the suite path came from
    line = one_line(arpo("params", "-S", f"env.in_domain_suite={suite}"))
    assert "click-buton" in line and "click-button" in line


def test_every_shipped_suite_names_known_tasks():
    assert miniwob_task_names() and "click-button" in miniwob_task_names()
    for suite in sorted((ROOT / "data/suites").glob("*.yaml")):
        assert unknown_suite_task(suite) is None, suite


def test_suite_task_check_reads_mapping_entries_and_skips_other_backends(tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "backend: miniwob\ntasks:\n  - click-test\n  - {task_id: osw-1, backend: osworld}\n"
        "  - task_id: enter-txet\n    note: typo\n"
    )
    assert unknown_suite_task(suite) == (
        f"names no MiniWoB task: 'enter-txet' ({suite}:5); closest known: enter-text, enter-text-2, enter-time"
    )
    suite.write_text("backend: miniwob\ntasks: [zzzzzz]\n")
    assert unknown_suite_task(suite).endswith("no known task is close")


@pytest.mark.parametrize(
    ("text", "args", "want"),
    [
        ("train:\n  lr: [1,\n", (), ":3:1: YAML syntax error"),  # file:line:column
        ("", (), "the params file is empty"),
        ("# only a comment\n", (), "the params file is empty"),
    ],
)
def test_bad_params_file_is_one_line_naming_the_file(tmp_path, text, args, want):
    bad = tmp_path / "params.yaml"
    bad.write_text(text)
    res = arpo("params", "-p", str(bad), *args)
    assert res.returncode == 2
    line = one_line(res)
    assert str(bad) in line and want in line


def test_override_and_preset_errors_name_what_was_given():
    res = arpo("params", "-S", "train.optimizer.lr=abc")
    assert res.returncode == 2
    assert "(set by command-line override -S train.optimizer.lr=abc)" in one_line(res)
    res = arpo("params", "--preset", "nosuch")
    line = one_line(res)
    assert "unknown preset 'nosuch'" in line and "quick" in line and "grpo" in line


def test_unexpected_exception_is_one_line_and_debug_shows_the_traceback(tmp_path):
    target = str(tmp_path / "no" / "such" / "dir" / "dvc.yaml")
    res = arpo("dvc-yaml", "--out", target)
    assert res.returncode == 1
    line = one_line(res)
    assert line.startswith("error: FileNotFoundError:") and "--debug" in line
    res = arpo("--debug", "dvc-yaml", "--out", target)
    assert res.returncode == 1 and "Traceback" in res.stderr and "FileNotFoundError" in res.stderr
