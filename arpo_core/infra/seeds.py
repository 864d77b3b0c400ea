"""One way to derive a seed from several parts: every RNG stream of the project goes through `derive_seed`.

Decisions:
- **Hashed seeds.** A derived seed is a hash of its parts, not arithmetic on them: `seed * 7919 + epoch`-style
  formulas collide (run seed 1 at epoch 0 == run seed 0 at epoch 7919) and streams that should be independent
  share values. sha256 over the parts' `repr`, joined by a separator that no repr contains unescaped,
  so ("a", 12) and ("a1", 2) differ.
- **Stable everywhere.** Stable everywhere: sha256 does not depend on the process, the platform or the Python
  version (unlike `hash()`, salted per process for strings), so a seed written in a test or a recorded run
  means the same thing in a worker process, a Ray actor or a later release.
- **Named streams.** The first part names the stream (its "purpose"), so two streams built from the same
  numbers never coincide. The streams of the project:
      "task_order", run_seed, epoch                     trainer: task order of an epoch
      "env", run_seed, epoch, iteration                 trainer: first env instance of an iteration's
                                                         groups (group g plays instance base + g)
      "sample", run_seed, epoch, iteration, job, step   rollout: the sampling seed of one generated
                                                         reply (job = index in the job list)
      "minibatch", run_seed, epoch, iteration           update: mini-batch order of one update
  Env instance seeds of evaluations, demos and baselines (`evaluate.seed + k`) are data - which
  MiniWoB instance is played - and stay plain numbers chosen by the caller.
- **Seed width.** The result is the first 8 bytes of the digest, big-endian, masked to `bits` bits (default
  63: a non-negative int64 that `torch.manual_seed`, `random.Random`, numpy and vLLM all accept). Env seeds
  use fewer bits because MiniWoB hands them to JavaScript, whose numbers are exact only below 2^53.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: int | str, bits: int = 63) -> int:
    """A seed in [0, 2**bits) determined by `parts` (decisions "Hashed seeds", "Stable everywhere",
    "Named streams" and "Seed width"); the first part names the stream.

    >>> derive_seed("sample", 0, 1, 0, 3, 2) == derive_seed("sample", 0, 1, 0, 3, 2)
    True
    >>> derive_seed("sample", 0, 1) != derive_seed("sample", 1, 0)
    True
    """
    if not parts:
        raise ValueError("derive_seed needs at least one part (the stream's name first)")
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, int | str):
            raise TypeError(f"seed parts must be int or str, got {p!r}")
    digest = hashlib.sha256("\x1f".join(repr(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << bits) - 1)
