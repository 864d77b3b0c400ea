"""Group-relative (GRPO) advantages from trajectory rewards.

Design decisions:
- **Group-contiguous rewards.** Rewards come group-contiguous: `rewards[g * G:(g + 1) * G]` are the G rollouts
  of group g (one task). This is how rollout lays out a batch and how replay fills a group; a batch whose
  length is not a multiple of G is an error, never silently regrouped.
- **Reference GRPO rule.** The reference code's rule (verl's `compute_grpo_outcome_advantage`) is scale
  "group" with eps 1e-6: `A_i = (r_i - mean(group)) / (std(group) + eps)`, UNBIASED std (`torch.std`). Scale
  and eps have no defaults here: params' `train.loss` (LossSection) holds them.
- **Scale registry.** The scale is chosen from a small registry, with TRL's names
  (`GRPOConfig.scale_rewards`):
  - "group": divide by the group's std (GRPO; verl `norm_adv_by_std_in_grpo=True`).
  - "batch": mean still per group, divide by the unbiased std of the WHOLE batch of rewards (TRL's
    `rewards.std()` for `scale_rewards="batch"`, after "Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning"): a group with tiny variance is not blown up to unit scale.
  - "none": `r - mean(group)` (Dr. GRPO, arXiv 2503.20783; verl `norm_adv_by_std_in_grpo=False`).
  TRL uses eps 1e-4 where verl and the ARPO code use 1e-6: eps is a parameter.
- **Singleton groups.** A group of size 1 has advantage 0 (no baseline to compare against: the same as TRL).
  verl instead uses mean 0 / std 1 for a singleton, i.e. A = r; we do not, since an unnormalised raw reward
  next to normalised ones would dominate the batch.
- **All-equal groups.** An all-equal group (all-fail, all-success, all 0.7) gets advantage exactly 0 under
  every scale. This needs an explicit rule: in float32 the mean of eight 0.7s differs from 0.7 by ~6e-8, and
  divided by (std 0 + eps 1e-6) that rounding error becomes advantages of +-0.056 (verl's formula has
  this defect). Constant groups are the "no gradient" case experience replay exists to fix, so they
  must give no gradient.
- **No gradient.** Advantages carry no gradient (computed under no_grad semantics: inputs are detached).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_SCALES", "group_advantages", "group_stats"]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """(N,) -> (N // G, G) float view, with clear errors for a bad layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = rewards.shape[0]
    if n == 0 or n % group_size != 0:
        raise ValueError(
            f"rewards has {n} entries, not a positive multiple of group_size={group_size}; rewards "
            "must be laid out group-contiguous (N = n_groups * group_size)"
        )
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    return r.view(-1, group_size)


def group_stats(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Per-group mean and unbiased std of rewards.

    Args:
        rewards: (N,) group-contiguous rewards, N = n_groups * group_size.
        group_size: G.

    Returns:
        (mean, std), each (n_groups,). The std of a group of size 1 is 0 (not NaN), so a replay
        rule like "failed = std < 0.05 and mean < 0.2" works for G = 1 too.
    """
    g = _grouped(rewards, group_size)  # (n_groups, G)
    mean = g.mean(dim=1)
    std = g.std(dim=1) if group_size > 1 else torch.zeros_like(mean)
    return mean, std


# Each scale maps (grouped rewards (n_groups, G), eps) -> a divisor broadcastable to (n_groups, G).
ADVANTAGE_SCALES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "group": lambda g, eps: g.std(dim=1, keepdim=True) + eps,
    "batch": lambda g, eps: g.flatten().std() + eps,
    "none": lambda g, eps: torch.ones((), dtype=g.dtype, device=g.device),
}


def group_advantages(rewards: Tensor, group_size: int, *, scale: str, eps: float) -> Tensor:
    """GRPO advantages: reward minus its group's mean, divided by a scale from `ADVANTAGE_SCALES`.

    Args:
        rewards: (N,) group-contiguous trajectory rewards, N = n_groups * group_size.
        group_size: G, rollouts per task.
        scale: "group" (GRPO, unbiased group std), "batch" (unbiased std of all N rewards) or "none"
            (Dr. GRPO, mean-centring only).
        eps: added to the std before dividing (reference code: 1e-6).

    Returns:
        (N,) advantages in the rewards' float dtype, no grad. Groups of size 1 get 0.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: {sorted(ADVANTAGE_SCALES)}")
    g = _grouped(rewards, group_size)  # (n_groups, G)
    if group_size == 1:
        return torch.zeros_like(g).view(-1)
    centred = g - g.mean(dim=1, keepdim=True)  # (n_groups, G)
    constant = g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)  # (n_groups, 1)
    # exact 0, not mean-rounding noise / eps (decision "All-equal groups")
    centred = centred.masked_fill(constant, 0.0)
    return (centred / ADVANTAGE_SCALES[scale](g, eps)).view(-1)
