"""Ctrl-C on `arpo run` in a real terminal (issue 34 item 1): the run stops within seconds with exit
status 130, its Prefect flow run and MLflow runs end in a final state (not Running), and no process it
started is left.

The run is started as a terminal starts a job: its own session with a pty as controlling terminal, its
process group in the foreground; Ctrl-C is the byte 0x03 written to the pty's master side, so the kernel's
line discipline sends SIGINT to the whole foreground process group, exactly what a user's Ctrl-C does.
Every process of the run carries a unique environment marker (ARPO_TEST_MARK), which is how the test
finds them, and only them, in /proc."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sqlite3
import subprocess
import termios
import time
import uuid
from pathlib import Path

import orchestration_helpers as oh
import pytest
from proctools import alive, wait_until


def marked(marker: str) -> list[int]:
    """Live processes whose environment holds ARPO_TEST_MARK=marker."""
    from arpo_core.envs.miniwob.miniwob_env import pids_with_env

    return [p for p in pids_with_env("ARPO_TEST_MARK", marker) if alive(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill_marked(marker: str) -> None:
    for pid in marked(marker):  # only this test's processes: they carry its marker
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class PtyJob:
    """A command run as the foreground job of a fresh terminal (a pty), its output collected."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str]):
        self.master, slave = os.openpty()

        def become_terminal_job() -> None:  # in the child, after fork: session leader owning the pty
            os.setsid()
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=become_terminal_job
        )
        os.close(slave)
        self.output = b""

    def pump(self, timeout_s: float = 0.2) -> None:
        """Read what the job wrote (the pty's buffer is small: an unread terminal blocks the writer)."""
        ready, _, _ = select.select([self.master], [], [], timeout_s)
        if ready:
            with contextlib.suppress(OSError):  # EIO: every writer has closed the terminal
                self.output += os.read(self.master, 65536)

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def wait_for(self, needle: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.pump()
            if needle in self.text():
                return True
        self.pump()
        return needle in self.text()

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")  # the line discipline turns it into SIGINT to the foreground group

    def wait(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pump()
            if self.proc.poll() is not None:
                self.pump()
                return self.proc.returncode
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        os.close(self.master)


def _final_states(project: Path) -> tuple[list[str], list[str]]:
    """(MLflow run statuses, Prefect flow run state types) recorded in the project's stores."""
    with contextlib.closing(sqlite3.connect(project / "mlflow.db")) as db:
        mlflow = [r[0] for r in db.execute("select status from runs")]
    prefect_db = project / ".prefect" / "prefect.db"
    with contextlib.closing(sqlite3.connect(prefect_db)) as db:
        prefect = [r[0] for r in db.execute("select state_type from flow_run")]
    return mlflow, prefect


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_in_a_terminal_stops_arpo_run_within_seconds(tmp_path):
    project = oh.copy_project(tmp_path / "proj")
    marker = uuid.uuid4().hex
    env = {**oh.base_env(project), "ARPO_TEST_MARK": marker, "TERM": "dumb"}
    env.pop("ARPO_RUN_LOCK", None)
    # --target ground: init_policy (seconds), then ground measures on MiniWoB screens, with a browser
    # and env workers up: the cheapest run that has every kind of process when it is interrupted.
    job = PtyJob([str(oh.VENV_BIN / "arpo"), "run", "--preset", "quick", "--target", "ground"], project, env)
    try:
        assert job.wait_for("ground: running", 300), job.text()[-3000:]

        def browser_up() -> bool:
            job.pump(0.0)
            return any(b"chrom" in _cmdline(p) for p in marked(marker))

        assert wait_until(browser_up, 120), job.text()[-3000:]  # inside the stage's work
        assert len(marked(marker)) >= 4, job.text()[-3000:]  # the run, guardian, Prefect's server, browser
        t0 = time.monotonic()
        job.ctrl_c()
        rc = job.wait(60)
        took = time.monotonic() - t0
        print(f"Ctrl-C -> exit {rc} in {took:.1f} s\n{job.text()[-2500:]}")
        assert rc is not None, f"still running 60 s after Ctrl-C:\n{job.text()[-3000:]}"
        assert rc == 130 and took < 20, f"rc {rc} after {took:.1f} s:\n{job.text()[-3000:]}"
        assert "ConnectError" not in job.text() and "Traceback" not in job.text(), job.text()[-3000:]
        assert wait_until(lambda: not marked(marker), 15), [_cmdline(p)[:200] for p in marked(marker)]
        mlflow, prefect = _final_states(project)
        assert mlflow and "RUNNING" not in mlflow and "KILLED" in mlflow, mlflow
        assert prefect and "RUNNING" not in prefect, prefect
        assert not (project / ".arpo" / "run.lock").read_text().strip()  # released, nothing to take over
    finally:
        job.close()
        kill_marked(marker)


def test_the_temporary_server_prefect_would_start_is_the_own_session_one(monkeypatch):
    """services.py, decision "One registered server", without starting it: after `own_session_server()`, the
    server every Prefect client asks for (`SubprocessASGIServer()`) is the one started in a session of its
    own; with a server configured there is none to make."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.services import own_session_server

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        server = own_session_server()
        assert server is not None and SubprocessASGIServer() is server
        assert type(server).__name__ == "OwnSessionServer" and not server.running
        assert own_session_server() is server  # once per process
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert own_session_server() is None and SubprocessASGIServer._instances == {}


def test_own_session_server_command_is_prefects_own(monkeypatch):
    """services.py, decision "One registered server": the copied command stays Prefect's (a Prefect upgrade
    that changes it fails here), with only start_new_session added."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.services import own_session_server

    calls = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        ours = own_session_server()
        ours.port = 8123
        ours._run_uvicorn_command()
        SubprocessASGIServer._run_uvicorn_command(ours)  # Prefect's own method on the same server
    mine, theirs = calls
    assert mine.pop("start_new_session") is True
    assert mine == theirs
