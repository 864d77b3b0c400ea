"""Stage `init_policy`: build the tiny Qwen2.5-VL offline, or point at a pretrained checkpoint."""

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
    from arpo_core.policy.model import build_tiny_policy

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if p.init_policy.pretrained:
        src = Path(p.init_policy.pretrained)
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"init_policy.pretrained: no checkpoint (config.json) at {src}")
        atomic_write_json(out_dir / POINTER, {"path": str(src.resolve())}, indent=None)
        return {"init_policy/pretrained": 1.0}
    ip = p.init_policy
    policy = build_tiny_policy(out_dir, size=ip.size, seed=ip.seed, rope_theta=ip.rope_theta, mrope=ip.mrope)
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
