"""No process outlives the `arpo run` that started it (issue 18 item 7): a run whose stage fails, and a
run SIGKILLed while its flow is running, leave no process behind (Prefect's temporary API server
included). Every process of the run carries a unique environment marker, which is how the test finds
them (and only them) in /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from pathlib import Path

import orchestration_helpers as oh
import pytest
from proctools import alive, wait_until


def _marked(marker: str) -> list[int]:
    """Live processes whose environment holds ARPO_TEST_MARK=marker."""
    out = []
    needle = f"ARPO_TEST_MARK={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if needle in env.split(b"\0") and alive(int(entry)):
                out.append(int(entry))
    return out


def _kill_marked(marker: str) -> None:
    for pid in _marked(marker):  # only this test's processes: they carry its marker
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stage_fails", "sigkill"])
def test_no_process_outlives_a_failed_or_killed_run(tmp_path, how):
    project = oh.copy_project(tmp_path / "proj")
    marker = uuid.uuid4().hex
    env = {**oh.base_env(project), "ARPO_TEST_MARK": marker}
    env.pop("ARPO_RUN_LOCK", None)
    # stage_fails: init_policy fails at once after Prefect's temporary server has started (`models` is
    # a file, so its output directory cannot be made); sigkill: a quick run killed while its ground stage
    # measures on MiniWoB pages (browsers and env workers up).
    if how == "stage_fails":
        (project / "models").write_text("not a directory")
    args = ["--preset", "quick"]
    log = (tmp_path / "run.log").open("w+")
    proc = subprocess.Popen(
        [str(oh.VENV_BIN / "arpo"), "run", *args],
        cwd=project,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        if how == "stage_fails":
            assert proc.wait(timeout=300) != 0
            text = (tmp_path / "run.log").read_text()
            assert "1/" in text and "init_policy" in text and "models" in text, text[-3000:]
        else:
            assert wait_until(lambda: "1/" in (tmp_path / "run.log").read_text(), 300), (
                tmp_path / "run.log"
            ).read_text()[-3000:]
            assert len(_marked(marker)) >= 3  # the run, its guardian, Prefect's server (at least)
            os.kill(proc.pid, signal.SIGKILL)  # the run only, not its group
            proc.wait(timeout=30)
        assert wait_until(lambda: not _marked(marker), 30), [
            Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in _marked(marker)
        ]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        _kill_marked(marker)
        log.close()
