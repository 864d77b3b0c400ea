"""The pipeline soak (benchmarks/soak.py) kills pool processes only: its target finder on a process table."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402

W = b"python\0-c\0boot\011\0100\0/tmp/arpo-envworker-abc\0"  # python -c BOOT FD PPID TMPDIR


def table() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (ppid, pgrp, cmdline): an `arpo run` (100) with a Prefect server, a trainer, two env workers
    (their reapers, which lead groups of their own to outlive a group kill; chromedriver; Chromium), and an env worker of another run (900)."""
    return {
        100: (1, 100, b"arpo\0run\0"),
        101: (100, 100, b"python\0-m\0uvicorn\0prefect.server.api.server:app\0"),
        102: (100, 100, b"python\0train\0"),
        200: (102, 200, W),
        201: (200, 201, b"python\0-S\0-c\0reaper\0200\0200\0/tmp/arpo-envworker-abc\0"),
        202: (200, 200, b"/usr/bin/chromedriver\0--port=1\0"),
        203: (202, 200, b"/usr/lib/chromium/chromium\0--user-data-dir=/tmp/arpo-envworker-abc/p\0"),
        204: (  # a zygote: in the worker's group, not the browser's main process
            203,
            200,
            b"/usr/lib/chromium/chromium\0--type=zygote\0--user-data-dir=/tmp/arpo-envworker-abc/p\0",
        ),
        300: (102, 300, W.replace(b"abc", b"def")),
        301: (300, 300, b"/usr/bin/chromedriver\0--port=2\0"),  # its browser has quit: no target
        900: (1, 900, W.replace(b"abc", b"zzz")),
        901: (900, 900, b"/usr/lib/chromium/chromium\0"),
    }


def test_targets_are_the_runs_env_workers_and_their_browsers_only():
    assert soak.pool_targets(100, table()) == {200: [202, 203], 300: []}


def test_no_targets_outside_the_run():
    assert soak.pool_targets(102, table()) == {200: [202, 203], 300: []}
    assert soak.pool_targets(101, table()) == {}
    assert soak.pool_targets(12345, table()) == {}


def test_fault_lines_parse_the_pools_own_warning_lines(caplog):
    import logging

    from arpo_core.envs.pool import EnvPool

    pool = EnvPool(lambda: None, 1)  # an unpicklable factory: the worker cannot start (one more fault line)
    pool._slots[0].task = ("miniwob", "click-test")
    with caplog.at_level(logging.WARNING, logger="arpo.envs"):
        pool._fault(pool._slots[0], "worker_crashes", "found when the pool closed: worker 7 found dead")
    pid = str(pool._slots[0].worker.pid)  # the worker whose start failed (its process had started)
    pool.close()
    lines = [
        r.getMessage() for r in caplog.records if r.name == "arpo.envs" and "click-test" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    line = lines[0]
    at, kind, env, task, pid, msg = soak.FAULT_LINE.search(
        f"bar 1/6 [00:03]12:00:01.250 | WARNING | {line}"
    ).groups()
    assert (at, kind, env, task, pid) == ("12:00:01.250", "worker_crashes", "0", "miniwob/click-test", pid)
    assert msg.startswith("found when the pool closed")
