"""Ctrl-C on the Prefect worker (scripts/prefect_worker.sh) does what it prints (issue 34 item 5): the first
waits for the running flow run to finish, a second stops it, and the stopped run leaves no Running flow
run in Prefect, no RUNNING run in MLflow, no held `.arpo/run.lock` and no process behind.

A real server, a real process worker and a real deployment run of the cheapest target that is still
running when interrupted (`targets=["ground"]` of the quick deployment: init_policy, then ground with a
browser). Ctrl-C is SIGINT to the worker script's process group, as a terminal sends it. Every process
carries a unique environment marker (ARPO_TEST_MARK), which is how the test finds them in /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import time
import uuid
from pathlib import Path

import orchestration_helpers as oh
import pytest
from proctools import group_pids, wait_until
from test_interrupt import _cmdline, kill_marked, marked

ROOT = Path(__file__).resolve().parents[1]


def _wait_log(log: Path, needle: str, timeout_s: float, proc=None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return True
        if proc is not None and proc.poll() is not None:
            return needle in log.read_text(errors="replace")
        time.sleep(0.5)
    return False


def _states(project: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({flow run name: state type}, {MLflow run name: status}) from the projects' stores."""
    with contextlib.closing(sqlite3.connect(project / ".prefect" / "prefect.db")) as db:
        prefect = {n: s for n, s in db.execute("select name, state_type from flow_run order by created")}
    with contextlib.closing(sqlite3.connect(project / "mlflow.db")) as db:
        mlflow = {n: s for n, s in db.execute("select name, status from runs order by start_time")}
    return prefect, mlflow


def _ground_running(project: Path) -> bool:
    """Whether the newest MLflow run named "ground" is RUNNING (False while the store is busy)."""
    try:
        return _states(project)[1].get("ground") == "RUNNING"
    except sqlite3.OperationalError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_worker_ctrl_c_waits_for_the_flow_run_and_a_second_stops_and_marks_it(tmp_path):
    project = oh.copy_project(tmp_path / "proj")
    (project / "scripts").mkdir()
    for name in ("prefect_env.sh", "prefect_server.sh", "prefect_worker.sh"):
        (project / "scripts" / name).write_bytes((ROOT / "scripts" / name).read_bytes())
        (project / "scripts" / name).chmod(0o755)
    port = oh.free_port()
    marker = uuid.uuid4().hex
    env = {**oh.base_env(project), "ARPO_TEST_MARK": marker}
    env.pop("ARPO_RUN_LOCK", None)
    env.update(PREFECT_PORT=str(port), PREFECT_WORKER_QUERY_SECONDS="2")
    cli_env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    server = oh.start(["bash", "scripts/prefect_server.sh"], project, env, tmp_path / "server.log")
    workers = []

    def start_worker(log: Path):
        worker = oh.start(["bash", "scripts/prefect_worker.sh"], project, env, log)
        workers.append(worker)
        assert _wait_log(log, "started", 120, worker), log.read_text()
        return worker

    def run_deployment(*params: str) -> None:
        out = oh.run(
            ["prefect", "deployment", "run", "arpo-train/quick", "--param", 'targets=["ground"]', *params],
            project,
            cli_env,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr

    try:
        oh.wait_http(f"http://127.0.0.1:{port}/api/health", 120, server, tmp_path / "server.log")
        log1 = tmp_path / "worker1.log"
        worker = start_worker(log1)
        out = oh.run(["prefect", "--no-prompt", "deploy", "--all"], project, cli_env, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr

        # 1. one Ctrl-C: the worker waits for the running flow run, which completes; then it stops
        run_deployment()
        assert _wait_log(log1, "ground: running", 400, worker), log1.read_text()[-3000:]
        os.killpg(worker.pid, signal.SIGINT)
        assert _wait_log(log1, "waiting for the running flow run", 20), log1.read_text()[-3000:]
        assert _wait_log(log1, "ground: done in", 300), log1.read_text()[-3000:]
        worker.wait(timeout=60)
        text1 = log1.read_text()
        assert "worker stopped" in text1, text1[-3000:]
        prefect, mlflow = _states(project)
        assert "COMPLETED" in prefect.values() and "RUNNING" not in prefect.values(), prefect
        assert set(mlflow.values()) == {"FINISHED"}, mlflow

        # 2. a second Ctrl-C stops the flow run, which marks its runs and releases the lock
        log2 = tmp_path / "worker2.log"
        worker = start_worker(log2)
        run_deployment("--param", "force=true")
        assert _wait_log(log2, "ground: running", 400, worker), log2.read_text()[-3000:]
        # the log line comes before the stage opens its MLflow run; on a loaded machine the Ctrl-Cs
        # could land in between, and there would be no ground run to mark
        assert wait_until(lambda: _ground_running(project), 300), _states(project)
        os.killpg(worker.pid, signal.SIGINT)
        assert _wait_log(log2, "waiting for the running flow run", 20), log2.read_text()[-3000:]
        t0 = time.monotonic()
        os.killpg(worker.pid, signal.SIGINT)
        worker.wait(timeout=90)
        print(f"second Ctrl-C: worker and flow run gone in {time.monotonic() - t0:.1f} s")
        text2 = log2.read_text()
        assert "worker stopped" in text2 and "ground: done in" not in text2, text2[-3000:]
        prefect, mlflow = _states(project)
        assert "RUNNING" not in prefect.values() and "CRASHED" in prefect.values(), prefect
        assert "RUNNING" not in mlflow.values() and "KILLED" in mlflow.values(), mlflow
        assert [n for n, s in mlflow.items() if s == "KILLED"] == [
            "quick · deployment arpo-train/quick",
            "ground",
        ]
        assert not (project / ".arpo" / "run.lock").read_text().strip()
        # nothing of the flow run is left: the only marked processes are the server's (its own group)
        left = lambda: set(marked(marker)) - set(group_pids(server.pid))  # noqa: E731
        assert wait_until(lambda: not left(), 20), [_cmdline(p)[:200] for p in left()]
    finally:
        for worker in workers:
            oh.stop(worker)
        oh.stop(server)
        kill_marked(marker)
