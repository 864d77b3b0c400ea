"""Stage `sft`: behaviour cloning of the grounded policy on the oracle demos -> the base policy."""

from __future__ import annotations

import os
from typing import Any

from arpo_core.config import Params
from arpo_core.offline import sft
from arpo_core.pipeline.common import resolve_policy, setup_torch
from arpo_core.policy.model import load_policy
from arpo_core.trajectory import read_trajectories

__all__ = ["run"]


def run(
    p: Params, policy_dir: str | os.PathLike, demos_path: str | os.PathLike, out_dir: str | os.PathLike
) -> dict[str, Any]:
    """Behaviour cloning; the policy is saved to `out_dir`."""
    setup_torch(p)
    policy = load_policy(resolve_policy(policy_dir))
    history = sft(
        policy,
        read_trajectories(demos_path),
        p.sft,
        checkpoint_dir=None,
        progress=True,
        system=p.policy.system_prompt,
        history_images=p.policy.history_images,
    )
    policy.save(out_dir)
    return {"sft/loss_first": history[0], "sft/loss_last": history[-1], "sft/steps": float(len(history))}
