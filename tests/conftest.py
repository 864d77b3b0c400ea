"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread, restored afterwards: two threads on this 2-core machine, beside other CPU-heavy
    work (browsers, other tests), measured 13x slower per step (spinning OpenMP workers; docs/method.md §6)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
