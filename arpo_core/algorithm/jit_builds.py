"""DeepSpeed's JIT-built ops, built so that a killed builder cannot wedge every later run.

Decisions:
- **Build locks that die with their builder.** torch guards each JIT build folder with a plain file
  (`<op>/lock` in the build root, torch.utils.file_baton) that only the builder that made it removes, and
  every other process waits on it with no time limit. A builder killed mid-build (Ctrl-C in the first run,
  a SIGKILLed rank, the end of a session) leaves it behind, and every later DeepSpeed engine on that
  machine then hangs: on CPU in `deepspeed.init_distributed` (its shared-memory op), on GPUs in FusedAdam.
  (Seen: one such file from a killed test run hung each DeepSpeed test of the next CI run until its
  15-minute timeout, which took the run past CI's 90 minutes.) So the ops a DeepSpeed engine needs are
  loaded here first, under an `flock` on the build root that the kernel drops when its holder dies however
  it dies. Every builder going through here holds it, so a torch lock file found while holding it is an
  orphan: it is removed, in one warning line naming it. DeepSpeed then finds the op loaded (its builders
  share one cache of loaded ops) and builds nothing itself. Ranks take the lock one after another before
  their process group exists, so no rank holds it while waiting on another. A build folder shared by several
  machines (a venv on NFS) needs a filesystem whose locks work across them (NFSv4's do); otherwise give each
  node its own `TORCH_EXTENSIONS_DIR`. A build outside this module (another program building into the same
  folder at that moment) is not waited for.
- **A build folder per environment.** With `TORCH_EXTENSIONS_DIR` unset, a virtual environment builds into
  its own `<venv>/torch-extensions` instead of the user's `~/.cache/torch_extensions`: a build there is
  keyed on the environment's include paths anyway (a second checkout rebuilds it), two checkouts no longer
  replace each other's build, and a clean checkout starts from no state left by another. A set
  `TORCH_EXTENSIONS_DIR` wins; outside a venv torch's default stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

_log = logging.getLogger(__name__)

LOCK_NAME = "arpo-builds.lock"
"""The flock file in the build root (decision "Build locks that die with their builder")."""


def build_root() -> Path:
    """Where torch builds JIT extensions in this process: `TORCH_EXTENSIONS_DIR`, else (in a venv) the venv's
    `torch-extensions`, which is then set for this process and its children (decision "A build folder
    per environment"), else torch's default."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR") and sys.prefix != sys.base_prefix:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch-extensions")
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


@contextlib.contextmanager
def exclusive_builds(root: Path | None = None) -> Iterator[Path]:
    """Hold the build root's flock for the block, after removing torch lock files its killed holders left
    (decision "Build locks that die with their builder"); yields the root."""
    root = build_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            # <root>/<op>/lock under TORCH_EXTENSIONS_DIR, <root>/<py>_<cu>/<op>/lock under torch's default
            for lock in sorted([*root.glob("*/lock"), *root.glob("*/*/lock")]):
                _log.warning("removing %s: the lock of a JIT build whose builder was killed mid-build", lock)
                lock.unlink(missing_ok=True)
            yield root
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load_deepspeed_ops(optimizer_op: str | None = None) -> list[str]:
    """Load (building if needed) the JIT ops a DeepSpeed engine is about to build: the shared-memory
    collective op that `init_distributed` builds where DeepSpeed's accelerator has one (CPU), and
    `optimizer_op` (the builder of DeepSpeed's AdamW: "FusedAdamBuilder", or "CPUAdamBuilder" with the
    optimizer offloaded) that `deepspeed.initialize` builds; returns the names loaded. Only builds run under
    the lock, no collective (decision "Build locks that die with their builder")."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builders = [accelerator.create_op_builder(name) for name in ("ShareMemCommBuilder", optimizer_op) if name]
    wanted = [b for b in builders if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False)]
    if not wanted:
        return []
    with exclusive_builds():
        for builder in wanted:
            builder.load(verbose=False)
    return [b.NAME for b in wanted]
