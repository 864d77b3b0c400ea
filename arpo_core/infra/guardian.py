"""No process outlives the run that started it: a guardian process that removes a run's children.

Decisions:
- **Guardian process.** A run (`arpo run`, `arpo stage`) starts processes it does not fully control: Prefect's
  temporary API server (stopped only by an `atexit` hook, so not when the run is killed or exits through
  `os._exit`), Ray's head processes, env workers (which have their own watchdogs, pool.py,
  decision "No orphans"). `start_guardian()` spawns a tiny process that records the run's direct children (pid
  and start time from /proc, every `PERIOD_S`) while the run lives, and once the run has gone (any way:
  success, failure, SIGTERM, SIGKILL) terminates those still alive - their whole process group when they lead
  one - with SIGTERM, then SIGKILL after `GRACE_S`.
- **Start-time identity.** The start time makes a recycled pid safe: a process is signalled only when its pid
  and start time both match what was recorded while it was the run's child.
- **Signal-proof guardian.** The guardian lives in its own process group and ignores SIGINT/SIGTERM, so a
  Ctrl-C or a kill of the run's group does not take it down before it has cleaned up; it exits right after
  cleaning.
- **Temp folder removal.** Once the processes are gone it removes the run's private temp folder
  (arpo_core/infra/lock.py, decision "Private temp folder", the run's TMPDIR when it is one), which a
  SIGKILLed run could not remove itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

from arpo_core.infra.lock import RUN_TMP_PREFIX

__all__ = ["GRACE_S", "PERIOD_S", "start_guardian"]

PERIOD_S = 0.5
GRACE_S = 5.0

_GUARDIAN = r"""
import os, signal, sys, time
run, period, grace = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
tmpdir = sys.argv[4] if len(sys.argv) > 4 else ""
me = os.getpid()
os.setpgid(0, 0)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields  # [state, ppid, pgrp, session, ..., starttime at index 19]

def children():
    out = {}
    for e in os.listdir("/proc"):
        if e.isdigit() and int(e) != me:
            s = stat(e)
            if s is not None and int(s[1]) == run and s[0] != "Z":
                out[int(e)] = s[19]
    return out

def same(pid, start):
    s = stat(pid)
    return s is not None and s[0] != "Z" and s[19] == start

seen = {}
while os.getppid() == run:
    seen = {p: st for p, st in seen.items() if same(p, st)}
    seen.update(children())
    time.sleep(period)

def signal_all(sig):
    for pid, start in seen.items():
        if not same(pid, start):
            continue
        s = stat(pid)
        try:
            if s is not None and int(s[2]) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

signal_all(signal.SIGTERM)
deadline = time.monotonic() + grace
while time.monotonic() < deadline and any(same(p, st) for p, st in seen.items()):
    time.sleep(0.1)
signal_all(signal.SIGKILL)
if tmpdir:
    import shutil
    shutil.rmtree(tmpdir, ignore_errors=True)
"""


def start_guardian(period_s: float = PERIOD_S, grace_s: float = GRACE_S) -> subprocess.Popen:
    """Decision "Guardian process": start the guardian of this process; it ends by itself after this process
    has."""
    tmp = os.environ.get("TMPDIR", "")
    tmpdir = tmp if os.path.basename(tmp).startswith(RUN_TMP_PREFIX) else ""  # decision "Temp folder removal"
    return subprocess.Popen(
        [sys.executable, "-S", "-c", _GUARDIAN, str(os.getpid()), str(period_s), str(grace_s), tmpdir],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )
