"""What a killed run leaves is closed by the next one (issue 34 items 5, 6): the lock takeover of a dead
holder removes its private temp folder (arpo_core/infra/lock.py, decision "Private temp folder") and ends its
MLflow runs KILLED (flows/services.py, decision "Dead run cleanup"); a SIGKILL of a whole `arpo run` process
tree leaves no RUNNING run, Running flow run or temp folder once the next run has started."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import orchestration_helpers as oh
import pytest
from proctools import wait_until
from test_interrupt import PtyJob, _cmdline, kill_marked, marked

from arpo_core.infra.lock import LOCK_ENV, RUN_TMP_PREFIX, lock_path, read_holder
from tracking import mlflow_runs

DIES_WITH_RUNS = textwrap.dedent(
    """
    import os, sys, time, tempfile
    from flows import services
    from tracking import mlflow_runs
    with services.run_lock(sys.argv[1], command="doomed"):
        c = mlflow_runs.client(sys.argv[1])
        exp = mlflow_runs.ensure_experiment(c, "arpo-test", sys.argv[1])
        parent = mlflow_runs.start_run(c, exp, "quick · arpo run", mlflow_runs.run_tags("pipeline", sys.argv[1]))
        stage = mlflow_runs.start_run(c, exp, "train", mlflow_runs.run_tags("train", sys.argv[1]), parent)
        done = mlflow_runs.start_run(c, exp, "ground", mlflow_runs.run_tags("ground", sys.argv[1]), parent)
        mlflow_runs.finish_run(c, done, True)
        worker_dir = tempfile.mkdtemp(prefix="arpo-envworker-")  # what an env worker makes
        print(os.environ["TMPDIR"], worker_dir, flush=True)
        time.sleep(300)
    """
)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != LOCK_ENV}


def test_takeover_closes_the_dead_runs_mlflow_runs_and_removes_its_temp_folder(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", DIES_WITH_RUNS, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=_env(),
    )
    try:
        run_tmp, worker_dir = proc.stdout.readline().split()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no clean release, no finally of any kind
        proc.wait(timeout=30)
    assert Path(run_tmp).name.startswith(RUN_TMP_PREFIX) and Path(worker_dir).parent == Path(run_tmp)
    assert Path(worker_dir).is_dir()
    c = mlflow_runs.client(tmp_path)
    before = {r["stage"]: r["status"] for r in mlflow_runs.run_rows(c, "arpo-test")}
    assert before == {"pipeline": "RUNNING", "train": "RUNNING", "ground": "FINISHED"}

    from flows import services

    services.DEAD_FLOW_RUNS.clear()
    with services.run_lock(tmp_path, command="next") as holder:
        assert holder["previous"]["pid"] == proc.pid
        assert not Path(run_tmp).exists()  # the dead run's temp folder, env worker folders included
        rows = {r["stage"]: r for r in mlflow_runs.run_rows(c, "arpo-test")}
        assert {k: r["status"] for k, r in rows.items()} == {
            "pipeline": "KILLED",
            "train": "KILLED",
            "ground": "FINISHED",  # a finished run stays as it was
        }
        ended = c.get_run(rows["train"]["run"]).data.tags["arpo.ended"]
        assert f"pid {proc.pid}" in ended and "died" in ended
        # and the run's own temp folder is its TMPDIR while it holds the lock
        assert os.environ["TMPDIR"] == holder["tmpdir"] and Path(holder["tmpdir"]).is_dir()
    assert not Path(holder["tmpdir"]).exists() and read_holder(lock_path(tmp_path)) is None
    services.DEAD_FLOW_RUNS.clear()


def _stores(project: Path) -> tuple[list[str], list[str]]:
    with contextlib.closing(sqlite3.connect(project / "mlflow.db")) as db:
        mlflow = [r[0] for r in db.execute("select status from runs")]
    with contextlib.closing(sqlite3.connect(project / ".prefect" / "prefect.db")) as db:
        prefect = [r[0] for r in db.execute("select state_type from flow_run")]
    return mlflow, prefect


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigkilled_run_tree_is_closed_by_the_next_run(tmp_path):
    project = oh.copy_project(tmp_path / "proj")
    marker = uuid.uuid4().hex
    env = {**oh.base_env(project), "ARPO_TEST_MARK": marker, "TERM": "dumb"}
    env.pop(LOCK_ENV, None)
    arpo = str(oh.VENV_BIN / "arpo")
    job = PtyJob([arpo, "run", "--preset", "quick", "--target", "ground"], project, env)
    try:
        assert job.wait_for("ground: running", 300), job.text()[-3000:]
        assert wait_until(lambda: any(b"chrom" in _cmdline(p) for p in marked(marker)), 120)
        run_tmp = Path(read_holder(lock_path(project))["tmpdir"])
        assert run_tmp.is_dir() and any(run_tmp.iterdir())  # the browser's profile, at least
        kill_marked(marker)  # the whole tree at once: run, guardian, server, browser, reapers
        job.proc.wait(timeout=30)
        assert wait_until(lambda: not marked(marker), 30)
        mlflow, prefect = _stores(project)
        assert "RUNNING" in mlflow and "RUNNING" in prefect  # what it left
        assert run_tmp.is_dir()
    finally:
        job.close()
        kill_marked(marker)
    # the next run (cheap: init_policy is up to date) takes the lock over and closes it all
    t0 = time.monotonic()
    nxt = oh.run([arpo, "run", "--preset", "quick", "--target", "init_policy"], project, env, timeout=300)
    print(f"next run: {time.monotonic() - t0:.0f} s")
    text = nxt.stdout + nxt.stderr
    assert nxt.returncode == 0, text[-3000:]
    assert "taking over the run lock" in text and "as KILLED" in text, text[-3000:]
    assert not run_tmp.exists()
    mlflow, prefect = _stores(project)
    assert "RUNNING" not in mlflow and mlflow.count("KILLED") == 2, mlflow  # the pipeline and ground
    assert "RUNNING" not in prefect and "CRASHED" in prefect, prefect
    kill_marked(marker)
