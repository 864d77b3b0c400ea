"""Process-table helpers shared by the tests that check no process is left behind (reads /proc)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, ...]; None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True for a running (non-zombie) process."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def pids_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (e.g. a browser profile dir)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmd and alive(int(entry)):
                out.append(int(entry))
    return out


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(entry)
            if stat is not None and stat[0] != "Z" and int(stat[2]) == pgid:
                out.append(int(entry))
    return out


def wait_until(pred, timeout_s: float = 10.0) -> bool:
    """Poll `pred` every 0.1 s until it is true (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False
