"""Atomic file writes: the one way every module of the project writes a result file.

Decisions:
- **Atomic writes.** Write to a unique temp file in the target's directory (same filesystem, so the rename is
  atomic), flush and fsync, then `os.replace`: a reader sees the old file or the new one, never half of one,
  and a process killed mid-write leaves the previous file intact (docs/design.md; the brief: "loses no data").
- **Temp cleanup on error.** On any error the temp file is removed and the error propagates.
- **Binary file handle.** `atomic_path` hands a writer (pyarrow, matplotlib, csv) an open binary file; the
  text/JSON helpers are thin wrappers over it.
- **Clear output errors.** A full disk or an unwritable output is one clear `OutputError` (an OSError with the
  original errno) saying what was being written, where, how much space it needed and how much is free
  (`write_error`), never a bare `[Errno 28]` or a library's `iostream error`: a writer that fails
  without an errno (torch's serializer, pyarrow) while the device is (nearly) full is reported as a
  full disk too, and so is one that quotes the errno in its message (safetensors, in Rust: "(os error
  28)") or raises from an error that has one. `check_space` fails before anything is written when the known
  need exceeds the free space, so the previous output is never touched by a write that cannot finish.
  `copy_tree` copies a directory the same way (space checked first, one such line for any file that fails),
  where `shutil.copytree` would report a list of per-file error tuples.
- **Cheap integrity checks.** Integrity checks are cheap and by file kind (`file_problem`): a safetensors
  file's size against the data offsets in its own header, a torch file's zip central directory (at its end, so
  a truncated file has none), a JSON file parses, a Parquet file's footer reads. They catch a truncated or
  half-written file without loading it; `sha256_file` is for manifests that must catch any change of content.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from arpo_core.infra.errors import NotRetryable

__all__ = [
    "OutputError",
    "atomic_open",
    "atomic_write_json",
    "atomic_write_text",
    "check_space",
    "copy_tree",
    "file_problem",
    "free_bytes",
    "sha256_file",
    "tree_size",
    "write_error",
]

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
NEARLY_FULL_BYTES = 16 << 20
"""Free space under which a writer's errno-less failure (torch, pyarrow) is taken for a full disk."""


class OutputError(NotRetryable, OSError):
    """Decision "Clear output errors": an output could not be written (disk full, read-only, no permission);
    the message says what, where and how much space. Not retried (errors.py, decision "NotRetryable marker"):
    a retry meets the same disk."""


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the filesystem of `path`, or of its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def tree_size(path: str | os.PathLike) -> int:
    """Bytes of the files under `path` (a file's own size); 0 when missing."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(p):
        for f in files:
            with suppress(OSError):
                total += (Path(dirpath) / f).stat().st_size
    return total


_ERRNO_TEXT = re.compile(r"(?:os error|errno) (\d+)", re.IGNORECASE)


def _errno_of(e: BaseException) -> int | None:
    """The errno of `e` or of an error in its chain; else one its message quotes, as writers in Rust or
    C++ do (safetensors: "I/O error: No space left on device (os error 28)")."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(getattr(cur, "errno", None), int):
            return cur.errno  # type: ignore[attr-defined]
        m = _ERRNO_TEXT.search(str(cur))
        if m:
            return int(m.group(1))
        cur = cur.__cause__ or cur.__context__
    return None


def write_error(
    e: BaseException, what: str, path: str | os.PathLike, needed: int | None = None
) -> OutputError | None:
    """Decision "Clear output errors": the clear error for `e`, raised while writing `what` at `path`; None
    when `e` is not a disk-space or permission failure."""
    if isinstance(e, OutputError):
        return e
    code = _errno_of(e)
    try:
        free = free_bytes(path)
    except OSError:
        free = -1
    need = f", about {_mb(needed)} needed" if needed else ""
    if code in DISK_FULL or (
        code is None and isinstance(e, RuntimeError | OSError) and 0 <= free < NEARLY_FULL_BYTES
    ):
        return OutputError(
            code if code in DISK_FULL else errno.ENOSPC,
            f"disk full while writing {what} to {path}: {_mb(max(free, 0))} free{need} "
            f"(free space on that device, then run again; the previous output is intact) [{type(e).__name__}: {e}]",
        )
    if code in UNWRITABLE:
        return OutputError(
            code, f"cannot write {what} to {path}: {os.strerror(code)} (check its permissions)"
        )
    return None


def check_space(path: str | os.PathLike, needed: int, what: str, margin: float = 1.1) -> None:
    """Decision "Clear output errors": raise `OutputError` before writing when `needed` bytes (times `margin`)
    do not fit."""
    free = free_bytes(path)
    if needed * margin > free:
        raise OutputError(
            errno.ENOSPC,
            f"not enough disk space to write {what} to {path}: about {_mb(int(needed * margin))} needed, "
            f"{_mb(free)} free (nothing was written; the previous output is intact)",
        )


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike, what: str) -> Path:
    """Decision "Clear output errors": copy every file under `src` into `dst` bit for bit (metadata as
    `shutil.copy2`), after checking the space; a full disk or an unwritable `dst` is one `OutputError` naming
    `what`."""
    src, dst = Path(src), Path(dst)
    needed = tree_size(src)
    check_space(dst, needed, what)
    try:
        for dirpath, _, files in os.walk(src):
            target = dst / Path(dirpath).relative_to(src)
            target.mkdir(parents=True, exist_ok=True)
            for name in sorted(files):
                shutil.copy2(Path(dirpath) / name, target / name)
    except OSError as e:
        err = write_error(e, what, dst, needed=needed or None)
        if err is None:
            raise
        raise err from e
    return dst


def _read_umask() -> int:
    """The process umask, read once at import (os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", needed: int | None = None) -> Iterator[IO[Any]]:
    """Open a temp file beside `path` for writing; on a clean exit it replaces `path`
    (decision "Atomic writes"). `needed`: the writer's estimate of the file's size, quoted by a disk-full
    error (decision "Clear output errors")."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes only ('wb' or 'w'), got mode {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        err = write_error(e, path.name, path.parent, needed=needed)
        if err is None:
            raise
        raise err from e
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # a plain file's mode (mkstemp's is 0600), e.g. 0644 for DVC outputs
        with os.fdopen(fd, mode, **({"encoding": "utf-8", "newline": ""} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        written = tree_size(tmp)
        Path(tmp).unlink(missing_ok=True)
        err = (
            write_error(e, path.name, path.parent, needed=max(written, needed or 0) or None)
            if isinstance(e, Exception)
            else None
        )
        if err is not None and err is not e:
            raise err from e
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)


def atomic_write_json(
    path: str | os.PathLike, data: Any, indent: int | None = 2, sort_keys: bool = False
) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


# ------------------------------------------------------------------------------------------------
# Integrity (decision "Cheap integrity checks")


def sha256_file(path: str | os.PathLike, fsync: bool = False) -> str:
    """sha256 of a file's content, read in 1 MB blocks; with `fsync`, the file is also flushed to disk
    (a checkpoint's manifest is written only once the files it describes are durable)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _safetensors_problem(path: Path, size: int) -> str | None:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path} is truncated ({size} bytes, not even a safetensors header)"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"{path} is truncated ({size} bytes; its header alone is {8 + n})"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return f"{path} has an unreadable safetensors header ({e})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    want = 8 + n + max(ends, default=0)
    if size != want:
        return f"{path} is truncated or padded ({size} bytes; its header describes {want})"
    return None


def file_problem(path: str | os.PathLike) -> str | None:
    """Decision "Cheap integrity checks": what is structurally wrong with the file at `path` (naming it), or
    None. Kinds checked: `.safetensors`, `.pt` (torch's zip format), `.json`, `.parquet`; other files only
    need to exist."""
    path = Path(path)
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    suffix = path.suffix
    try:
        if suffix == ".safetensors":
            return _safetensors_problem(path, size)
        if suffix == ".pt" and not zipfile.is_zipfile(path):
            return f"{path} is truncated or not a torch file ({size} bytes, no zip directory at its end)"
        if suffix == ".json":
            json.loads(path.read_bytes())
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.read_metadata(path)
    except (ValueError, OSError, KeyError, TypeError) as e:  # pyarrow's ArrowInvalid is a ValueError
        return f"{path} is unreadable ({type(e).__name__}: {e})"
    return None
