"""Atomic file writes: the one way every module of the project writes a result file.

Decisions:
1. Write to a unique temp file in the target's directory (same filesystem, so the rename is atomic),
   flush and fsync, then `os.replace`: a reader sees the old file or the new one, never half of one, and
   a process killed mid-write leaves the previous file intact (docs/design.md; the brief: "loses no data").
2. On any error the temp file is removed and the error propagates.
3. `atomic_path` hands a writer (pyarrow, matplotlib, csv) an open binary file; the text/JSON helpers
   are thin wrappers over it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_open", "atomic_write_json", "atomic_write_text"]


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file beside `path` for writing; on a clean exit it replaces `path` (decision 1)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes only ('wb' or 'w'), got mode {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8", "newline": ""} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)


def atomic_write_json(
    path: str | os.PathLike, data: Any, indent: int | None = 2, sort_keys: bool = False
) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
