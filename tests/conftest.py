"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import time

import pytest
import torch

# The whole run's wall-clock budget in seconds, counted from the controller's start (scripts/test.sh):
# past it, each test not yet started fails at once, named, so a run that has gone slow (a hung test,
# a slow machine) still ends with its summary before CI's own limit kills it without one.
DEADLINE_ENV = "ARPO_TEST_DEADLINE_S"
_START_ENV = "ARPO_TEST_T0"
_config: pytest.Config | None = None


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh runs two workers), each worker's in-process torch work uses
    one thread: two workers with two threads each on two cores spin against each other (see
    `one_thread`). Pipeline subprocesses already use `project.torch_threads` (1). The controller stamps
    the run's start for the workers it spawns (`DEADLINE_ENV`)."""
    global _config
    _config = config
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    else:
        os.environ[_START_ENV] = str(time.time())


def _elapsed() -> float:
    """Seconds since the controller started the run (0 outside scripts/test.sh's runs)."""
    return time.time() - float(os.environ.get(_START_ENV) or time.time())


def pytest_runtest_setup(item):
    deadline = float(os.environ.get(DEADLINE_ENV) or 0)
    if deadline and _elapsed() > deadline:
        pytest.fail(f"not run: the suite's {deadline:.0f} s budget ({DEADLINE_ENV}) was spent", pytrace=False)


def pytest_runtest_logreport(report):
    """Each failure named the moment the controller hears of it (the `-rfE` summary comes only at the
    end, and a run killed from outside never prints it): node id, phase, seconds, the error's last line."""
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER") or _config is None:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = [ln for ln in (crash.message if crash else report.longreprtext).splitlines() if ln.strip()]
    reason = " | ".join(lines)[:300] or "?"
    terminal = _config.pluginmanager.get_plugin("terminalreporter")
    line = f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s, at {_elapsed():.0f} s): {reason}"
    if terminal is not None:
        terminal.write_line("")
        terminal.write_line(line)


@pytest.fixture
def one_thread():
    """One torch thread, restored afterwards: two threads on this 2-core machine, beside other CPU-heavy
    work (browsers, other tests), measured 13x slower per step (spinning OpenMP workers; docs/method.md §6)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
