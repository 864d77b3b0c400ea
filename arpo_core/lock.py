"""One run per working tree: an exclusive lock held while `arpo run`, `arpo stage` or a DVC stage runs.

Decisions:
1. `fcntl.flock` on `.arpo/run.lock` under the project root. The kernel drops the lock when its holder
   dies (even by SIGKILL), so a dead holder never blocks a new run; the file also holds who took it
   (pid, command, start time, a random token) as JSON, so a refused run can name the holder and a new
   run can tell that the previous holder died without releasing (then it warns and takes over).
2. A second run fails at once (`RunLocked`, naming the holder), it never waits: two runs in one tree
   interleave their stages' outputs (one run's `sft` rewrites `models/base` while the other's `evaluate`
   reads it), and waiting would only hide that a run is still going.
3. Re-entrant within the holding process (the `arpo run` flow and every stage flow it calls, Prefect
   retries of a task, which run in the same process): a nested `run_lock` is a no-op.
4. Children of the holder (subprocesses of an `arpo run`, e.g. a stage run as `arpo stage`) inherit
   `ARPO_RUN_LOCK` = `<lock file>:<token>`; a process whose variable names the token in the lock file,
   while the holder process lives, is inside the holder's run and proceeds without taking the lock.
5. The lock file is opened close-on-exec (Python's default), so processes a run starts (the Prefect
   server, browsers, env workers) never hold it: when the run dies, the lock goes with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LOCK_ENV", "LOCK_NAME", "RunLocked", "lock_path", "pid_alive", "read_holder", "run_lock"]

LOCK_NAME = Path(".arpo") / "run.lock"
"""The lock file, relative to the project root."""
LOCK_ENV = "ARPO_RUN_LOCK"
"""Environment variable carrying `<lock file>:<token>` to the holder's children (decision 4)."""

log = logging.getLogger("arpo.lock")

_held: dict[str, dict[str, Any]] = {}
"""Lock file (resolved) -> {"fd", "token", "depth"} for the locks this process holds (decision 3)."""
_guard = threading.Lock()


class RunLocked(RuntimeError):
    """Another live run holds the working tree's lock; the message names it."""

    def __init__(self, path: Path, holder: dict[str, Any] | None):
        self.path = path
        self.holder = holder or {}
        super().__init__(f"another arpo run is using this working tree: {describe(self.holder)} holds {path}")


def lock_path(root: str | os.PathLike = ".") -> Path:
    return (Path(root) / LOCK_NAME).resolve()


def describe(holder: dict[str, Any]) -> str:
    """'pid 123 (arpo run --preset quick), started 2026-12-01 10:00:00 (42 s ago)'."""
    if not holder:
        return "an unknown process"
    started = holder.get("started")
    when = ""
    if isinstance(started, int | float):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        when = f", started {stamp} ({time.time() - started:.0f} s ago)"
    return f"pid {holder.get('pid', '?')} ({holder.get('command', '?')}){when}"


def pid_alive(pid: Any) -> bool:
    """A running (non-zombie) process has this pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_holder(path: str | os.PathLike) -> dict[str, Any] | None:
    """The JSON the lock file holds (its last holder), or None when empty or unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) and data else None


def _inherited(path: Path) -> bool:
    """Decision 4: this process is a child of the live holder of `path`."""
    value = os.environ.get(LOCK_ENV, "")
    where, _, token = value.rpartition(":")
    if not token or where != str(path):
        return False
    holder = read_holder(path)
    return bool(holder) and holder.get("token") == token and pid_alive(holder.get("pid"))


@contextlib.contextmanager
def run_lock(root: str | os.PathLike = ".", command: str | None = None) -> Iterator[dict[str, Any] | None]:
    """Hold the working tree's run lock for the duration of the block (decisions 1-4).

    Raises `RunLocked` at once when another live process holds it. Yields the holder record written
    (None when the lock was already held by this process or by the run this process belongs to).
    """
    path = lock_path(root)
    key = str(path)
    with _guard:
        if key in _held:  # decision 3
            _held[key]["depth"] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield None
        finally:
            with _guard:
                _held[key]["depth"] -= 1
        return
    if _inherited(path):  # decision 4
        yield None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunLocked(path, read_holder(path)) from None
    except BaseException:
        os.close(fd)
        raise
    previous = read_holder(path)
    if previous and previous.get("pid") != os.getpid():
        log.warning(
            "taking over the run lock %s: its holder %s ended without releasing it (%s)",
            path,
            describe(previous),
            "no longer running" if not pid_alive(previous.get("pid")) else "it no longer holds the lock",
        )
    token = secrets.token_hex(8)
    holder = {
        "pid": os.getpid(),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": time.time(),
        "token": token,
        "cwd": str(Path(root).resolve()),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    with _guard:
        _held[key] = {"fd": fd, "token": token, "depth": 1}
    old_env = os.environ.get(LOCK_ENV)
    os.environ[LOCK_ENV] = f"{path}:{token}"
    try:
        yield holder
    finally:
        with _guard:
            _held.pop(key, None)
        if old_env is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = old_env
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # released cleanly: the next holder has nothing to take over
        os.close(fd)
