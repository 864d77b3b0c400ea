"""Errors a retry cannot fix, and the one question orchestration asks about an error: retry or not.

Decisions:
- **NotRetryable marker.** `NotRetryable` marks an error that the same call with the same inputs would raise
  again: a full disk or an unwritable output (`fileio.OutputError`), bad input (`InputError`: a file that
  cannot be read as what it must be, e.g. a truncated Parquet or safetensors file, a trajectory file without a
  column of the data contract). Prefect retries env stages (tasks/stages.py); `retryable` is its
  `retry_condition_fn`'s test, so a disk-full or a corrupted input fails at once with its one-line
  message instead of three times after minutes of back-off (issue 34 item 4).
- **Whole exception chain.** The whole exception chain counts (`raise X from e`, and an error raised while
  handling another): a library that wraps an OutputError or an ENOSPC in its own error type does not make it
  retryable. A bare OSError with a disk-full or read-only errno counts as an OutputError would.
- **Retryable by default.** Everything else stays retryable: env faults (a browser crash, a reset timeout) are
  what retries are for, and an unknown error is given the benefit of the doubt the stage table's `envs` flag
  grants.
"""

from __future__ import annotations

import errno

__all__ = ["InputError", "NotRetryable", "retryable"]

_NOT_RETRYABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


class NotRetryable(Exception):
    """Decision "NotRetryable marker": raising this (or a subclass) says a retry cannot help."""


class InputError(NotRetryable, ValueError):
    """An input file is unreadable, truncated or not what it must be; the message names the file."""


def retryable(exc: BaseException) -> bool:
    """Decisions "NotRetryable marker", "Whole exception chain" and "Retryable by default": False when `exc`
    or any error in its chain is not retryable."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NotRetryable):
            return False
        if isinstance(e, OSError) and e.errno in _NOT_RETRYABLE_ERRNOS:
            return False
        e = e.__cause__ or e.__context__
    return True
