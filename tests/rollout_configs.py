"""The RolloutConfig the rollout, evaluation and simulation tests build (one definition)."""

from __future__ import annotations

from dataclasses import replace

from arpo_core.algorithm.rollout import RolloutConfig


def rollout_cfg(**over) -> RolloutConfig:
    """A RolloutConfig as a stage builds it from params (train section values, the tiny policy's pixels)."""
    base = RolloutConfig(
        max_steps=5,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=64,
        format_penalty=-1.0,
        min_pixels=3136,
        max_pixels=1003520,
        coord_mode="absolute",
        seed=0,
    )
    return replace(base, **over)
