"""Stage `init_policy`: build the tiny Qwen2.5-VL or Qwen3-VL (`init_policy.family`) offline, or point at a
pretrained checkpoint. The tiny Qwen3-VL is saved in the Hub's sharded layout (`TINY_SHARD_SIZE`), so
every later stage loads it the way it would load GUI-Owl-1.5 (policy/model.py, decision "Tiny Qwen3-VL")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from arpo_core.config import Params
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.pipeline.policies import POINTER
from arpo_core.pipeline.stage import Stage

__all__ = ["STAGE", "run"]


def run(p: Params, out_dir: str | os.PathLike) -> dict[str, Any]:
    """`init_policy.pretrained` set: a pointer file to it (policies.py `resolve_policy`); else the tiny policy."""
    from arpo_core.policy.model import TINY_SHARD_SIZE, build_tiny_policy

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if p.init_policy.pretrained:
        src = Path(p.init_policy.pretrained)
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"init_policy.pretrained: no checkpoint (config.json) at {src}")
        atomic_write_json(out_dir / POINTER, {"path": str(src.resolve())}, indent=None)
        return {"init_policy/pretrained": 1.0}
    ip = p.init_policy
    policy = build_tiny_policy(
        out_dir,
        size=ip.size,
        seed=ip.seed,
        rope_theta=ip.rope_theta,
        mrope=ip.mrope,
        family=ip.family,
        max_shard_size=TINY_SHARD_SIZE if ip.family == "qwen3_vl" else None,
    )
    n = sum(x.numel() for x in policy.model.parameters())
    return {"init_policy/parameters": float(n), "init_policy/vocab": float(len(policy.tokenizer))}


STAGE = Stage(
    "init_policy",
    run=run,
    params=("init_policy",),
    inputs={},
    outputs={"out_dir": "models/init"},
    artifacts={"models/init": "policy"},
)
