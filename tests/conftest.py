"""Fixtures shared by several test files."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh runs two workers), each worker's in-process torch work uses
    one thread: two workers with two threads each on two cores spin against each other (see
    `one_thread`). Pipeline subprocesses already use `project.torch_threads` (1)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One torch thread, restored afterwards: two threads on this 2-core machine, beside other CPU-heavy
    work (browsers, other tests), measured 13x slower per step (spinning OpenMP workers; docs/method.md §6)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
