"""The run lock of a working tree (arpo_core/infra/lock.py) and the guardian (arpo_core/infra/guardian.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orchestration_helpers as oh
import pytest
from proctools import alive, group_pids, wait_until

from arpo_core.infra.lock import LOCK_ENV, RunLocked, lock_path, probe, read_holder, run_lock

HOLD = textwrap.dedent(
    """
    import sys, time
    from arpo_core.infra.lock import run_lock
    with run_lock(sys.argv[1], command="holder-cmd --preset quick"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)
TRY = textwrap.dedent(
    """
    import sys
    from arpo_core.infra.lock import RunLocked, run_lock
    try:
        with run_lock(sys.argv[1], command="second"):
            print("acquired", flush=True)
    except RunLocked as e:
        print("locked:", e, flush=True)
    """
)


def _holder(root: Path, seconds: float = 60.0) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={k: v for k, v in os.environ.items() if k != LOCK_ENV},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _try(root: Path, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    out = subprocess.run(
        [sys.executable, "-c", TRY, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )
    return out.stdout.strip()


def test_second_process_is_refused_at_once_naming_the_holder(tmp_path):
    holder = _holder(tmp_path)
    try:
        t0 = time.monotonic()
        out = _try(tmp_path)
        assert time.monotonic() - t0 < 30
        assert out.startswith("locked:"), out
        assert f"pid {holder.pid}" in out and "holder-cmd --preset quick" in out and "started " in out
        record = read_holder(lock_path(tmp_path))
        assert record["pid"] == holder.pid and record["command"] == "holder-cmd --preset quick"
    finally:
        _stop(holder)


def test_in_process_raise_names_holder(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"), run_lock(tmp_path):
            pass
    finally:
        _stop(holder)


def test_lock_of_a_killed_holder_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = _holder(tmp_path)
    _stop(holder)  # SIGKILL: no clean release, the record stays
    assert read_holder(lock_path(tmp_path))["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="arpo.lock"), run_lock(tmp_path, command="me") as rec:
        assert rec["pid"] == os.getpid()
        assert read_holder(lock_path(tmp_path))["command"] == "me"
    assert any(
        f"pid {holder.pid}" in r.getMessage() and "taking over" in r.getMessage() for r in caplog.records
    )
    # released cleanly: the next run takes it without a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="arpo.lock"), run_lock(tmp_path):
        pass
    assert not caplog.records
    assert read_holder(lock_path(tmp_path)) is None


def test_reentrant_in_the_holding_process_and_inherited_by_children(tmp_path):
    with run_lock(tmp_path, command="outer") as rec:
        with run_lock(tmp_path) as inner:  # a stage flow inside `arpo run`, a Prefect retry
            assert inner is None
        assert read_holder(lock_path(tmp_path))["token"] == rec["token"]
        # a child carrying the token (an `arpo stage` subprocess of the run) proceeds
        assert _try(tmp_path, {LOCK_ENV: os.environ[LOCK_ENV]}) == "acquired"
        # a process with a wrong token, or none, is refused
        assert _try(tmp_path, {LOCK_ENV: f"{lock_path(tmp_path)}:0000"}).startswith("locked:")
        assert _try(tmp_path).startswith("locked:")
    assert LOCK_ENV not in os.environ
    assert _try(tmp_path) == "acquired"


def test_cli_stage_fails_fast_naming_the_holder(tmp_path):
    project = oh.copy_project(tmp_path / "proj")
    holder = _holder(project)
    try:
        env = {k: v for k, v in oh.base_env(project).items() if k != LOCK_ENV}
        t0 = time.monotonic()
        out = subprocess.run(
            [str(oh.VENV_BIN / "arpo"), "stage", "select"],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 3, out.stderr
        assert time.monotonic() - t0 < 60
        assert f"pid {holder.pid}" in out.stderr and "holder-cmd" in out.stderr
        assert not (project / ".arpo" / "stamps").exists()  # nothing of the stage ran
        assert json.loads(lock_path(project).read_text())["pid"] == holder.pid
    finally:
        _stop(holder)


GUARDED = textwrap.dedent(
    """
    import subprocess, sys, time
    from arpo_core.infra.guardian import start_guardian
    start_guardian(period_s=0.1, grace_s=2.0)
    # a child in its own group with a grandchild (like Prefect's server, Ray's head), and a plain child
    lead = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
        " time.sleep(300)"], start_new_session=True)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(lead.pid, plain.pid, flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(1)
    """
)


@pytest.mark.parametrize("how", ["fails", "sigkill"])
def test_guardian_removes_children_of_a_run_that_ended(how):
    proc = subprocess.Popen(
        [sys.executable, "-c", GUARDED, "1" if how == "fails" else "300"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lead = plain = -1
    try:
        lead, plain = (int(x) for x in proc.stdout.readline().split())
        time.sleep(0.5)  # the guardian has recorded both
        if how == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_until(lambda: not alive(lead) and not alive(plain), 20)
        # the grandchild in lead's group went with it
        assert wait_until(lambda: not group_pids(lead), 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in (
            p for p in (lead, plain) if p > 0
        ):  # only if the guardian failed: the test's own processes
            if alive(pid):
                os.killpg(pid, signal.SIGKILL) if pid == lead else os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------
# DVC beside a live run (lock.py, decision "DVC repository lock"): real DVC, outputs byte-identical


def _tree_bytes(project: Path) -> dict[str, bytes]:
    """Every file DVC could touch: the outputs, dvc.lock, DVC's cache."""
    out = {}
    for top in ("models", "metrics", "data/demos", ".dvc/cache"):
        for f in sorted((project / top).rglob("*")):
            if f.is_file():
                out[str(f.relative_to(project))] = f.read_bytes()
    out["dvc.lock"] = (project / "dvc.lock").read_bytes()
    return out


@pytest.mark.timeout(300)
def test_dvc_beside_a_live_run_changes_nothing_and_says_why(tmp_path):  # ~12 s: four DVC commands
    project = oh.copy_project(tmp_path / "proj")
    env = {k: v for k, v in oh.base_env(project).items() if k != LOCK_ENV}
    oh.git(project, "init", "-q")
    oh.git(project, "add", "-A")
    oh.git(project, "commit", "-qm", "project")
    # init_policy's outputs recorded by DVC (dvc.lock, cache), without running the stage
    for rel, text in {
        "models/init/config.json": '{"recorded": true}',
        "metrics/init_policy.json": "{}",
        "metrics/details/init_policy.json": "{}",
    }.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    out = oh.run(["dvc", "commit", "-f", "init_policy"], project, env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # ... then a live run rewrites them and is writing ground's: what `dvc repro` used to check out
    # (init_policy from the cache) and delete (ground's outputs, before running `arpo stage ground`)
    (project / "models/init/config.json").write_text('{"the live run": "writing"}')
    (project / "models/grounded").mkdir(parents=True)
    (project / "models/grounded/model.safetensors").write_bytes(b"\0" * 1000)
    (project / "metrics/ground.json").write_text("{}")
    before = _tree_bytes(project)
    holder = _holder(project)
    try:
        for cmd in (["dvc", "repro"], ["dvc", "exp", "run", "-S", "train.replay.enabled=false"]):
            t0 = time.monotonic()
            res = oh.run(cmd, project, env, timeout=120)
            took = time.monotonic() - t0
            assert res.returncode != 0, res.stdout + res.stderr
            errors = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("ERROR")]
            assert len(errors) == 1 and "Unable to acquire lock" in errors[0], res.stdout + res.stderr
            assert "Running stage" not in res.stdout and "checking out" not in res.stdout, res.stdout
            assert _tree_bytes(project) == before, f"{cmd} changed files"
            print(f"{' '.join(cmd)}: refused in {took:.1f} s: {errors[0][:120]}")
        # `make repro` asks first, in our words
        res = oh.run([str(oh.VENV_BIN / "arpo"), "lock"], project, env, timeout=120)
        assert res.returncode == 3 and f"pid {holder.pid}" in res.stderr, res.stdout + res.stderr
    finally:
        _stop(holder)
    # the holder gone, DVC gets its lock again
    res = oh.run(["dvc", "status"], project, env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _tree_bytes(project) == before


def test_a_run_holds_dvcs_lock_with_dvcs_own_primitive(tmp_path):
    """lock.py, decision "DVC repository lock", against zc.lockfile itself (DVC's default repository lock)."""
    import zc.lockfile

    (tmp_path / ".dvc").mkdir()
    dvc_lock = tmp_path / ".dvc" / "tmp" / "lock"
    holder = _holder(tmp_path)
    try:
        with pytest.raises(zc.lockfile.LockError):  # what makes DVC say "Unable to acquire lock"
            zc.lockfile.LockFile(str(dvc_lock))
        assert dvc_lock.read_text().split() == [str(holder.pid)]  # zc.lockfile's content
    finally:
        _stop(holder)
    # a DVC command busy in the tree: a run is refused at once, naming it; `probe` says the same
    dvc = zc.lockfile.LockFile(str(dvc_lock))
    try:
        out = _try(tmp_path)
        assert out.startswith("locked:") and "a DVC command is using this working tree" in out, out
        assert f"pid {os.getpid()}" in out
        assert "DVC command" in str(probe(tmp_path))
    finally:
        dvc.close()
    assert probe(tmp_path) is None and _try(tmp_path) == "acquired"
    # without .dvc/ there is no DVC lock to take
    plain = tmp_path / "plain"
    plain.mkdir()
    with run_lock(plain):
        assert not (plain / ".dvc").exists()
