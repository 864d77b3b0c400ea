"""Stage `sft`: behaviour cloning of the grounded policy on the oracle demos -> the base policy.

With `demos.episodes_per_task: 0` there are no demos and no behaviour cloning: the grounded policy is
the base, passed through as it is (a pretrained model's pointer file, or the tiny checkpoint copied file
by file), so a pretrained checkpoint such as UI-TARS-1.5 goes from `init_policy` to `baseline` untouched."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arpo_core.config import Params
from arpo_core.infra.fileio import atomic_write_text, copy_tree
from arpo_core.pipeline.policies import POINTER, resolve_policy, setup_torch
from arpo_core.pipeline.stage import Stage
from arpo_core.policy.prompt import PromptSpec, Reply
from arpo_core.trajectory import Trajectory, read_trajectories

if TYPE_CHECKING:  # torch and transformers load when the stage runs, not when the table is read
    from arpo_core.policy.model import Policy

__all__ = ["STAGE", "long_replies", "run"]

log = logging.getLogger("arpo.sft")


def long_replies(policy: Policy, demos: list[Trajectory], max_new_tokens: int) -> tuple[int, int, int]:
    """(demo replies the policy cannot finish within `max_new_tokens`, replies, the longest one's tokens):
    a reply's tokens and its closing `<|im_end|>` (what generation must produce before it stops)."""
    from arpo_core.policy.sequences import reply_ids

    lengths = [
        len(reply_ids(policy, Reply(s.response_text, tuple(s.response_token_ids or ())))[0])
        for t in demos
        for s in t.steps
    ]
    return sum(n > max_new_tokens for n in lengths), len(lengths), max(lengths, default=0)


def run(
    p: Params, policy_dir: str | os.PathLike, demos_path: str | os.PathLike, out_dir: str | os.PathLike
) -> dict[str, Any]:
    """Behaviour cloning; the policy is saved to `out_dir`."""
    demos = read_trajectories(demos_path)
    if p.demos.episodes_per_task == 0:  # the module docstring's pass-through
        if demos:
            raise ValueError(f"sft: demos.episodes_per_task is 0 but {demos_path} holds {len(demos)} demos")
        src, out = Path(policy_dir), Path(out_dir)
        if (src / POINTER).exists():
            atomic_write_text(out / POINTER, (src / POINTER).read_text())
        else:
            # a full disk is one line saying what, where and how much (fileio.py,
            # decision "Clear output errors")
            copy_tree(src, out, f"the base policy (a copy of {src})")
        return {"sft/steps": 0.0}
    from arpo_core.offline.behaviour_cloning import sft
    from arpo_core.policy.model import grow_depth, load_policy

    setup_torch(p)
    policy = load_policy(resolve_policy(policy_dir))
    if p.sft.grow_after:  # more depth for the replies' text, same function until trained
        policy = grow_depth(policy, p.sft.grow_after, seed=p.sft.seed)
    n_long, n_replies, longest = long_replies(policy, demos, p.policy.max_new_tokens)
    if n_long:  # cloned, but every rollout of such a step ends cut off: a format error
        log.warning(
            "sft: %d of %d demo replies are longer than policy.max_new_tokens=%d (the longest: %d tokens with "
            "its <|im_end|>); the policy cannot finish them and every such step will be a format error. "
            "Raise policy.max_new_tokens.",
            n_long,
            n_replies,
            p.policy.max_new_tokens,
            longest,
        )
    pointing: list[float] = []
    history = sft(
        policy,
        demos,
        p.sft,
        checkpoint_dir=None,
        progress=True,
        spec=PromptSpec(p.policy.system_prompt, p.policy.history_images),
        point_history=pointing,
    )
    policy.save(out_dir)
    point = {"sft/point_loss_first": pointing[0], "sft/point_loss_last": pointing[-1]} if pointing else {}
    return {
        **point,
        "sft/loss_first": history[0],
        "sft/loss_last": history[-1],
        "sft/steps": float(len(history)),
        "sft/layers": float(policy.model.config.text_config.num_hidden_layers),
        "sft/replies_over_max_new_tokens": float(n_long),
        "sft/longest_reply_tokens": float(longest),
    }


STAGE = Stage(
    "sft",
    run=run,
    params=(
        "sft",
        "demos.episodes_per_task",
        "policy.system_prompt",
        "policy.history_images",
        "policy.max_new_tokens",
    ),
    inputs={"policy_dir": "models/grounded", "demos_path": "data/demos"},
    outputs={"out_dir": "models/base"},
    artifacts={"models/base": "policy"},
)
