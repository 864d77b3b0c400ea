"""Helpers for the orchestration tests: a project copy, free ports, servers started and stopped by pid.

Every process is started in its own session (process group) and stopped through that group only, so
a test never touches processes it did not start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# What a deployment or `dvc repro` needs from the project (code deps are hashed from the copy).
PROJECT_FILES = (
    "arpo_core",
    "flows",
    "tasks",
    "presets",
    "params.yaml",
    "prefect.yaml",
    "dvc.yaml",
    ".dvcignore",
    ".gitignore",
    ".dvc/config",
    ".dvc/.gitignore",
    "data/suites",
    "data/osworld",
    "assets/checkpoints",
)


def copy_project(dst: Path) -> Path:
    """Copy the files a pipeline run needs into `dst` (no outputs, no bytecode)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in PROJECT_FILES:
        src, out = ROOT / rel, dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, ignore=ignore)
        else:
            shutil.copy2(src, out)
    return dst


def write_quick_params(project: Path) -> None:
    """params.yaml := params.yaml with presets/quick.yaml merged in: how the quick preset reaches DVC,
    which reads only params.yaml (docs/orchestration.md)."""
    out = subprocess.run(
        [str(VENV_BIN / "arpo"), "params", "--preset", "quick"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (project / "params.yaml").write_text(out.stdout)


def git(project: Path, *args: str) -> None:
    """`git ARGS` in `project` with a fixed test identity (a DVC experiment needs a commit)."""
    subprocess.run(
        ["git", "-c", "user.email=test@example.com", "-c", "user.name=test", *args],
        cwd=project,
        check=True,
        capture_output=True,
        timeout=60,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(project: Path) -> dict[str, str]:
    """Environment of a child process: the venv first on PATH, project-local Prefect/MLflow state."""
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PREFECT_HOME=str(project / ".prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_DISABLE_TELEMETRY="true",
        DVC_NO_ANALYTICS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def start(
    cmd: list[str], cwd: Path, env: dict[str, str], log: Path, sigint_ignored: bool = False
) -> subprocess.Popen:
    """Start `cmd` in a new session, output to `log`. `sigint_ignored`: start it with SIGINT ignored, as
    a background job of a non-interactive shell (nohup, a supervisor) starts."""
    fh = log.open("w")
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignore
    )


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGINT to the process group we started (graceful shutdown), SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # children of an exited leader
        return
    _kill_group(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    _kill_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_http(
    url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {log.read_text()[-3000:] if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s: {log.read_text()[-3000:] if log else ''}")


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run to completion; the output is returned (and shown on failure by the caller's assert)."""
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def replace_stage_run(monkeypatch, name: str, run) -> None:
    """Stage `name` runs `run` instead of its module's function for this test: the stage objects are
    frozen and the front doors look stages up in one dict (arpo_core/pipeline/table.py `BY_NAME`)."""
    import dataclasses

    from arpo_core.pipeline.table import BY_NAME

    monkeypatch.setitem(BY_NAME, name, dataclasses.replace(BY_NAME[name], run=run))
