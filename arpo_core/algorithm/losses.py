"""Clipped token-level policy loss (PPO/GRPO with dual clip), KL-to-reference estimators, aggregation.

Design decisions:
- **Dual clip.** The per-token objective is verl's `compute_policy_loss` (volcengine/verl,
  verl/trainer/ppo/core_algos.py), which the ARPO reference code (an EasyR1/verl fork) uses:
      ratio = exp(clamp(logps - old_logps, -20, 20))
      pg1 = -A * ratio;  pg2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)
      clipped = max(pg1, pg2)
      per_token = min(clipped, -A * clip_dual) where A < 0 else clipped        (dual clip)
  ARPO: clip_low 0.2, clip_high 0.3 (asymmetric, "clip-higher"), clip_dual 3.0 (docs/method.md §2).
  The [-20, 20] clamp of the log-ratio is verl's guard against exp overflow; it only bites where the
  token is clipped anyway. `clip_dual=None` switches the dual clip off; otherwise it must be > 1.
- **Clip fractions.** Clip fractions are over masked tokens of the whole batch, each a disjoint event where
  the gradient of that token is cut (and the token is not counted when A = 0):
      low  = A < 0 and ratio < 1 - clip_low
      high = A > 0 and ratio > 1 + clip_high
      dual = A < 0 and ratio > clip_dual   (the -A * ratio term exceeds -A * clip_dual)
  low + high is verl's `pg_clipfrac`; dual is verl's `pg_clipfrac_lower`.
- **KL before aggregation.** KL to a reference policy is added per token BEFORE aggregation (`per_token +=
  kl_coef * kl`, as TRL and verl's `use_kl_loss` do). Estimators from a registry, named after Schulman's
  "Approximating KL divergence" (verl's names in brackets), with d = logps - ref_logps:
      k1 = d  ["kl"];   k2 = 0.5 * d^2  ["mse"];
      k3 = exp(-d) + d - 1  ["low_var_kl"], with -d clamped to [-20, 20] and the result to [-10, 10]
  exactly as verl does (k3 >= 0, so the upper clamp at 10 is the one that acts: beyond it the token's
  KL gradient is cut, which keeps a rare huge log-ratio from dominating the update). ARPO runs with
  kl_coef 0; `ref_logps` may then be None.
- **Loss aggregation.** Aggregation from a registry, matching verl's `agg_loss` (B sequences, T padded length,
  m the mask):
      "token-mean":              sum(l * m) / sum(m)                         (ARPO / verl default)
      "seq-mean-token-mean":     mean_b( sum_t(l * m) / sum_t(m) )            (TRL "grpo")
      "seq-mean-token-sum":      mean_b( sum_t(l * m) )
      "seq-mean-token-sum-norm": sum(l * m) / sum_norm,  sum_norm = T unless given
  The last one is verl's Dr. GRPO mode: verl divides the batch sum by `loss_mask.shape[-1]` (the padded
  response length, not multiplied by B), and notes that the divisor should really be a constant over
  training; `sum_norm` lets a caller fix it (e.g. the max response length). TRL's "dr_grpo" divides by
  B * max_completion_length instead, i.e. verl's value / B. Denominators are clamped at 1 so a fully
  masked batch or row gives 0, not NaN (TRL's `.clamp(min=1.0)`; verl adds 1e-8).
- **Masked tokens excluded.** Masked tokens never reach the arithmetic: logps, old_logps and ref_logps are
  replaced by 0 under the mask before anything else, so padding that holds -inf or NaN cannot turn into a NaN
  loss or gradient. The mask is read as boolean (nonzero = assistant token). old_logps, ref_logps and
  advantages are detached; the math runs in float32 whatever the input dtype (bf16 log-probs lose the small
  ratios).
- **Typed loss output.** The output is a typed `LossOutput` (TorchRL style): `loss` carries the graph; every
  other field is a detached scalar tensor for metrics. No `.item()`, no logging: the caller decides what to
  sync. `approx_kl` is cleanrl's k3 estimate of KL(old || new) from the sampled tokens,
  mean((ratio - 1) - log ratio); verl logs the k1 form mean(old - new) as `ppo_kl`.
- **No loss defaults.** The loss settings (clips, KL, aggregation) are required keyword arguments without
  defaults: `LossSection` (params `train.loss`) holds the only defaults, so no caller can run a clip range
  other than the one params name by forgetting an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LossOutput",
    "aggregate",
    "kl_estimate",
    "masked_mean",
    "policy_loss",
]


class LossOutput(NamedTuple):
    """Result of `policy_loss`. Every field but `loss` is detached; all are 0-dim tensors or None."""

    loss: Tensor
    """Total loss to backpropagate: aggregated (policy-gradient + kl_coef * kl) per-token loss."""
    pg_loss: Tensor
    """The policy-gradient part alone, aggregated the same way."""
    kl: Tensor | None
    """Token-mean over masked tokens of the KL estimate to the reference; None without ref_logps."""
    clip_low_frac: Tensor
    """Fraction of masked tokens with A < 0 and ratio < 1 - clip_low."""
    clip_high_frac: Tensor
    """Fraction of masked tokens with A > 0 and ratio > 1 + clip_high."""
    clip_dual_frac: Tensor
    """Fraction of masked tokens with A < 0 and ratio > clip_dual (0 when the dual clip is off)."""
    approx_kl: Tensor
    """Token-mean of (ratio - 1) - log(ratio): k3 estimate of KL(old || new)."""
    entropy: Tensor | None
    """Token-mean of the given per-token entropy; None when none was given."""


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """`values` where mask is nonzero, exactly 0 elsewhere (even where values is NaN or inf)."""
    return torch.where(mask != 0, values, 0.0)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over positions where `mask` is nonzero; 0 when the mask is empty. (B, T) -> ()."""
    return _masked(values, mask).sum() / (mask != 0).sum().clamp(min=1).to(values.dtype)


# ---- KL estimators: (logps, ref_logps) (B, T) -> per-token estimate (B, T) -------------------------


def _kl_k1(logps: Tensor, ref_logps: Tensor) -> Tensor:
    return logps - ref_logps


def _kl_k2(logps: Tensor, ref_logps: Tensor) -> Tensor:
    return 0.5 * (logps - ref_logps).square()


def _kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    log_r = torch.clamp(ref_logps - logps, min=-20.0, max=20.0)  # verl: exp overflow guard
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)  # verl's low_var_kl clamp


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}


def kl_estimate(logps: Tensor, ref_logps: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs. (B, T) -> (B, T)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logps, ref_logps)


# ---- Aggregation: (per-token loss (B, T), float mask (B, T), sum_norm) -> scalar --------------------


def _agg_token_mean(loss: Tensor, mask: Tensor, sum_norm: float | None) -> Tensor:
    return masked_mean(loss, mask)


def _agg_seq_mean_token_mean(loss: Tensor, mask: Tensor, sum_norm: float | None) -> Tensor:
    per_seq = _masked(loss, mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)  # (B,)
    return per_seq.mean()


def _agg_seq_mean_token_sum(loss: Tensor, mask: Tensor, sum_norm: float | None) -> Tensor:
    return _masked(loss, mask).sum(dim=-1).mean()


def _agg_seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, sum_norm: float | None) -> Tensor:
    norm = float(mask.shape[-1]) if sum_norm is None else float(sum_norm)  # verl: loss_mask.shape[-1]
    return _masked(loss, mask).sum() / norm


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, float | None], Tensor]] = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
    "seq-mean-token-sum-norm": _agg_seq_mean_token_sum_norm,
}


def aggregate(
    loss: Tensor, mask: Tensor, agg: str, sum_norm: float | None, row_weights: Tensor | None = None
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar over masked tokens with a mode from `AGGREGATIONS`.

    `sum_norm` is the divisor of "seq-mean-token-sum-norm" (None: T = mask.shape[-1], as verl).
    `row_weights` (B,) scale each row's contribution in the `seq-mean-*` modes (a trajectory split into
    several rows, update.py, decision "Windowed trajectories"); "token-mean" takes none, its unit is the
    token.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; valid: {sorted(AGGREGATIONS)}")
    if sum_norm is not None and sum_norm <= 0:
        raise ValueError(f"sum_norm must be > 0, got {sum_norm}")
    if row_weights is not None:
        if agg == "token-mean":
            raise ValueError("row_weights apply to the seq-mean-* aggregations; token-mean weighs tokens")
        if row_weights.shape != loss.shape[:1]:
            raise ValueError(f"row_weights must be ({loss.shape[0]},), got {tuple(row_weights.shape)}")
        loss = loss * row_weights.to(loss.dtype).unsqueeze(-1)
    return AGGREGATIONS[agg](loss, (mask != 0).to(loss.dtype), sum_norm)


# ---- The loss ---------------------------------------------------------------------------------------


def _check_shapes(logps: Tensor, named: dict[str, Tensor | None], advantages: Tensor) -> None:
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, T), got shape {tuple(logps.shape)}")
    for name, t in named.items():
        if t is not None and t.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logps' {tuple(logps.shape)}")
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(
            f"advantages must be (B,) or (B, T) = {tuple(logps.shape[:1])} or {tuple(logps.shape)}, "
            f"got {tuple(advantages.shape)}"
        )


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_dual: float | None,
    kl_coef: float,
    kl_estimator: str,
    agg: str,
    sum_norm: float | None,
    ref_logps: Tensor | None = None,
    entropy: Tensor | None = None,
    row_weights: Tensor | None = None,
) -> LossOutput:
    """Clipped (asymmetric + dual-clip) surrogate loss over assistant tokens, plus optional KL to ref.

    Args:
        logps: (B, T) log-probs of the sampled tokens under the policy being trained (with grad).
        old_logps: (B, T) the same under the policy that is being improved on (recomputed before the
            update, docs/method.md §1); detached here.
        advantages: (B,) one advantage per trajectory, broadcast over its tokens, or (B, T).
        mask: (B, T) 1 on assistant tokens (thought + action + end-of-turn), 0 elsewhere.
        clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high].
        clip_dual: dual-clip constant c > 1 bounding the loss of A < 0 tokens at -A * c; None = off.
        kl_coef: weight of the per-token KL estimate added to the loss (ARPO: 0).
        kl_estimator: "k1", "k2" or "k3" (see module docstring).
        agg: aggregation mode, a key of `AGGREGATIONS`.
        sum_norm: divisor of "seq-mean-token-sum-norm" (None: T).
        ref_logps: (B, T) reference-policy log-probs; required when kl_coef != 0.
        entropy: (B, T) optional per-token entropy, reported as a masked token-mean.
        row_weights: (B,) optional weight of each row in the `seq-mean-*` aggregations (`aggregate`).

    Returns:
        LossOutput; `loss` is a 0-dim float32 tensor with grad, the rest detached.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; valid: {sorted(AGGREGATIONS)}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
    if sum_norm is not None and sum_norm <= 0:
        raise ValueError(f"sum_norm must be > 0, got {sum_norm}")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if clip_dual is not None and clip_dual <= 1.0:
        raise ValueError(f"clip_dual must be > 1 (verl's clip_ratio_c) or None, got {clip_dual}")
    if kl_coef != 0.0 and ref_logps is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logps")
    others = {"old_logps": old_logps, "mask": mask, "ref_logps": ref_logps, "entropy": entropy}
    _check_shapes(logps, others, advantages)

    on = mask.bool()  # (B, T)
    m = on.float()  # (B, T)
    # Zero the padding first: -inf / NaN there must not reach exp() or the backward pass
    # (decision "Masked tokens excluded").
    logps = torch.where(on, logps.float(), 0.0)  # (B, T)
    old_logps = torch.where(on, old_logps.detach().float(), 0.0)  # (B, T)
    adv = advantages.detach().float()
    adv = adv.unsqueeze(-1).expand_as(logps) if adv.dim() == 1 else adv  # (B, T)
    adv = torch.where(on, adv, 0.0)

    log_ratio = torch.clamp(logps - old_logps, min=-20.0, max=20.0)  # (B, T) verl's overflow guard
    ratio = torch.exp(log_ratio)  # (B, T)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)  # (B, T) PPO clip
    if clip_dual is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_dual), pg)  # dual clip (Ye et al. 2019)

    per_token = pg
    kl_metric = None
    if ref_logps is not None:
        ref = torch.where(on, ref_logps.detach().float(), 0.0)  # (B, T)
        kl = KL_ESTIMATORS[kl_estimator](logps, ref)  # (B, T)
        per_token = pg + kl_coef * kl
        kl_metric = masked_mean(kl.detach(), m)

    with torch.no_grad():
        r = ratio.detach()
        low = (adv < 0) & (r < 1.0 - clip_low)
        high = (adv > 0) & (r > 1.0 + clip_high)
        dual = (adv < 0) & (r > clip_dual) if clip_dual is not None else torch.zeros_like(on)
        approx_kl = masked_mean((r - 1.0) - log_ratio.detach(), m)
        ent = masked_mean(entropy.detach().float(), m) if entropy is not None else None
        pg_loss = aggregate(pg.detach(), m, agg, sum_norm, row_weights)

    return LossOutput(
        loss=aggregate(per_token, m, agg, sum_norm, row_weights),
        pg_loss=pg_loss,
        kl=kl_metric,
        clip_low_frac=masked_mean(low.float(), m),
        clip_high_frac=masked_mean(high.float(), m),
        clip_dual_frac=masked_mean(dual.float(), m),
        approx_kl=approx_kl,
        entropy=ent,
    )
