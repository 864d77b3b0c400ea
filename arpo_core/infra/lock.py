"""One run per working tree: an exclusive lock held while `arpo run`, `arpo stage` or a DVC stage runs.

Decisions:
- **flock lock file.** `fcntl.flock` on `.arpo/run.lock` under the project root. The kernel drops the lock
  when its holder dies (even by SIGKILL), so a dead holder never blocks a new run; the file also holds who
  took it (pid, command, start time, a random token) as JSON, so a refused run can name the holder and a new
  run can tell that the previous holder died without releasing (then it warns and takes over).
- **Fail at once.** A second run fails at once (`RunLocked`, naming the holder), it never waits: two runs in
  one tree interleave their stages' outputs (one run's `sft` rewrites `models/base` while the other's
  `evaluate` reads it), and waiting would only hide that a run is still going.
- **Re-entrant lock.** Re-entrant within the holding process (the `arpo run` flow and every stage flow it
  calls, Prefect retries of a task, which run in the same process): a nested `run_lock` is a no-op.
- **Inherited lock.** Children of the holder (subprocesses of an `arpo run`, e.g. a stage run as `arpo stage`)
  inherit `ARPO_RUN_LOCK` = `<lock file>:<token>`; a process whose variable names the token in the lock file,
  while the holder process lives, is inside the holder's run and proceeds without taking the lock.
- **Close-on-exec.** The lock file is opened close-on-exec (Python's default), so processes a run starts (the
  Prefect server, browsers, env workers) never hold it: when the run dies, the lock goes with it.
- **DVC repository lock.** A live run also holds DVC's repository lock, `.dvc/tmp/lock` (in a tree with
  `.dvc/`), with the primitive DVC's default lock uses (zc.lockfile: `fcntl.flock`, exclusive, non-blocking,
  on that file, which is never deleted; DVC's own pid format " <pid>\n" as content). Every DVC command that
  can change the workspace (`repro`, `exp run`, `checkout`, `commit`, `add`, `gc`, `pull`, `status`,
  ...; dvc/repo/__init__.py `locked`) takes that lock before it reads or writes anything, and fails
  after 3 s of retries when it cannot: so a `dvc repro` beside a live run changes nothing (before,
  it checked out cached outputs and removed others before its first `arpo stage` refused on our
  lock, issue 34 item 2). DVC releases the lock only while a stage's command runs
  (dvc/stage/run.py `unlocked_repo`), which is where its `arpo stage` takes it; an `arpo` run that
  finds it held (a DVC command busy in this tree) is refused like one that finds our lock held.
  Under `core.hardlink_lock` DVC uses flufl's protocol instead and this lock does not cover it.
- **Private temp folder.** Each holder has a private temp folder, `<temp dir>/arpo-run-<token>`, made its
  TMPDIR (and `tempfile.tempdir`) while it holds the lock, so everything the run and its children put in the
  temp directory (env workers' folders, browser profiles, desktops: ~2.5 MB per env worker) lies in one
  folder whose name the lock file records. It is removed on release; after a SIGKILL of the whole
  process tree (the env workers' reapers included) the guardian or, failing that, the next run's
  takeover removes it (issue 34 item 6).
- **Takeover record.** A takeover yields the dead holder's record as `previous`, so the front door can close
  what the dead run left open (its MLflow runs, its Prefect flow run: flows/services.py): the library only
  knows files. `current_token()` is the token of the run this process belongs to (held or inherited), which
  the run's records carry to make that possible.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DVC_LOCK",
    "LOCK_ENV",
    "LOCK_NAME",
    "RUN_TMP_PREFIX",
    "RunLocked",
    "current_token",
    "lock_path",
    "pid_alive",
    "probe",
    "read_holder",
    "remove_run_tmpdir",
    "run_lock",
]

LOCK_NAME = Path(".arpo") / "run.lock"
"""The lock file, relative to the project root."""
LOCK_ENV = "ARPO_RUN_LOCK"
"""Environment variable carrying `<lock file>:<token>` to the holder's children
(decision "Inherited lock")."""

log = logging.getLogger("arpo.lock")

_held: dict[str, dict[str, Any]] = {}
"""Lock file (resolved) -> {"fd", "token", "depth"} for the locks this process holds
(decision "Re-entrant lock")."""
_guard = threading.Lock()


class RunLocked(RuntimeError):
    """Another live run holds the working tree's lock; the message names it."""

    def __init__(self, path: Path, holder: dict[str, Any] | None, message: str | None = None):
        self.path = path
        self.holder = holder or {}
        super().__init__(
            message or f"another arpo run is using this working tree: {describe(self.holder)} holds {path}"
        )


DVC_LOCK = Path(".dvc") / "tmp" / "lock"
"""DVC's repository lock, relative to the project root (decision "DVC repository lock")."""


def _dvc_pid(path: Path) -> str:
    """The pid zc.lockfile wrote into DVC's lock (" <pid>\n"), or '?'."""
    try:
        text = path.read_text().split()
    except OSError:
        return "?"
    return text[0] if text else "?"


def _take_dvc_lock(root: Path) -> int | None:
    """Decision "DVC repository lock": hold DVC's repository lock; returns its fd (None outside a DVC
    project). Raises `RunLocked` naming the DVC process when a DVC command holds it."""
    if not (root / ".dvc").is_dir():
        return None
    path = (root / DVC_LOCK).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunLocked(
            path, None, f"a DVC command is using this working tree: pid {_dvc_pid(path)} holds {path}"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f" {os.getpid()}\n".encode(), 0)  # zc.lockfile's content
    return fd


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


RUN_TMP_PREFIX = "arpo-run-"
"""Decision "Private temp folder": a holder's private temp folder is `<temp dir>/arpo-run-<token>`."""


def current_token() -> str | None:
    """Decision "Takeover record": the lock token of the run this process belongs to (its own or inherited),
    or None."""
    token = os.environ.get(LOCK_ENV, "").rpartition(":")[2]
    return token or None


def remove_run_tmpdir(holder: dict[str, Any] | None) -> bool:
    """Remove a (dead) holder's private temp folder (decision "Private temp folder"); only a folder named for
    the holder's token is ever removed. Returns whether one was there."""
    holder = holder or {}
    folder, token = holder.get("tmpdir"), holder.get("token")
    if not isinstance(folder, str) or not isinstance(token, str) or not token:
        return False
    path = Path(folder)
    if path.name != f"{RUN_TMP_PREFIX}{token}" or not path.is_dir() or path.is_symlink():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _inherited(path: Path) -> bool:
    """Decision "Inherited lock": this process is a child of the live holder of `path`."""
    value = os.environ.get(LOCK_ENV, "")
    where, _, token = value.rpartition(":")
    if not token or where != str(path):
        return False
    holder = read_holder(path)
    return bool(holder) and holder.get("token") == token and pid_alive(holder.get("pid"))


def probe(root: str | os.PathLike = ".") -> RunLocked | None:
    """Who would refuse a run in `root` now: `RunLocked` naming the live holder of the run lock or of
    DVC's lock (decision "DVC repository lock"), or None when a run could start. Changes neither file."""
    for path, error in (
        (lock_path(root), lambda p: RunLocked(p, read_holder(p))),
        (
            (Path(root) / DVC_LOCK).resolve(),
            lambda p: RunLocked(
                p, None, f"a DVC command is using this working tree: pid {_dvc_pid(p)} holds {p}"
            ),
        ),
    ):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # never made: free
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared and held for an instant only
        except BlockingIOError:
            return error(path)
        finally:
            os.close(fd)  # closing drops the probe's lock
    return None


@contextlib.contextmanager
def run_lock(root: str | os.PathLike = ".", command: str | None = None) -> Iterator[dict[str, Any] | None]:
    """Hold the working tree's run lock for the duration of the block (decisions "flock lock file",
    "Fail at once", "Re-entrant lock" and "Inherited lock").

    Raises `RunLocked` at once when another live process holds it. Yields the holder record written
    (None when the lock was already held by this process or by the run this process belongs to).
    """
    path = lock_path(root)
    key = str(path)
    with _guard:
        if key in _held:  # decision "Re-entrant lock"
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
    if _inherited(path):  # decision "Inherited lock"
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
    try:
        dvc_fd = _take_dvc_lock(Path(root))  # decision "DVC repository lock"
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
        remove_run_tmpdir(previous)  # decision "Private temp folder"
    else:
        previous = None
    token = secrets.token_hex(8)
    old_tmp, old_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    run_tmp = Path(tempfile.gettempdir()) / f"{RUN_TMP_PREFIX}{token}"
    run_tmp.mkdir(mode=0o700)
    holder = {
        "pid": os.getpid(),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": time.time(),
        "token": token,
        "cwd": str(Path(root).resolve()),
        "tmpdir": str(run_tmp),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    with _guard:
        _held[key] = {"fd": fd, "token": token, "depth": 1}
    old_env = os.environ.get(LOCK_ENV)
    os.environ[LOCK_ENV] = f"{path}:{token}"
    os.environ["TMPDIR"], tempfile.tempdir = str(run_tmp), str(run_tmp)  # decision "Private temp folder"
    try:
        yield {**holder, "previous": previous} if previous else holder  # decision "Takeover record"
    finally:
        with _guard:
            _held.pop(key, None)
        for var, value in ((LOCK_ENV, old_env), ("TMPDIR", old_tmp)):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        tempfile.tempdir = old_tempdir
        shutil.rmtree(run_tmp, ignore_errors=True)
        if dvc_fd is not None:
            os.close(dvc_fd)  # DVC's lock first: our lock still keeps another arpo run out meanwhile
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # released cleanly: the next holder has nothing to take over
        os.close(fd)
