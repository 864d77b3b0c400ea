"""The GRPO/ARPO policy update: trajectories + advantages -> clipped policy-gradient optimizer steps.

Decisions:
- **Trajectory as sequence.** One trajectory = one sequence (docs/method.md §1), or several when its
  screenshots exceed the history window (decision "Windowed trajectories"); its advantage is given to every
  assistant token. Sequences are encoded once per update (images processed once) and reused for the
  old-log-prob pass and every PPO epoch.
- **Recomputed old log-probs.** Old log-probs are recomputed by the trainer under the current weights before
  the update, in eval mode and without grad, not taken from the inference engine (docs/method.md §1). For a
  replayed trajectory this is the current policy too: ARPO applies no staleness correction. When the update is
  one optimizer step on fresh weights (ppo_epochs 1 and one mini-batch holding every sequence), that
  recomputation equals the training forward's own log-probs, so those are used (detached) and the
  extra no-grad forward is skipped: the ratio is exactly 1, as the recomputation gives up to float
  noise. This removes ARPO's overhead over a bare fwd+bwd+step in that case (benchmarks/results/
  update_overhead.json: +37% with the extra forward).
- **Exact micro-batching.** Micro-batching is exact: each micro-batch's loss is weighted so that the sum over
  micro-batches equals the loss of the whole mini-batch in one piece. For `token-mean` the weight is (masked
  tokens in the micro-batch) / (masked tokens in the mini-batch); for the `seq-mean-*` modes it is
  (sequences in the micro-batch) / (sequences in the mini-batch). A plain average of per-micro-batch
  token-means would silently turn token-mean into seq-mean-token-mean at micro-batch 1.
- **Seeded mini-batches.** A mini-batch (`mini_batch_size` trajectories) is one optimizer step; the reference
  takes 2 optimizer steps of 64 trajectories per 128-trajectory iteration. Mini-batches are drawn in a seeded
  order (the caller's `seed`, the "minibatch" stream of seeds.py).
- **Engine interface.** The optimizer and gradient clipping live behind a small `Engine` interface so the same
  loop drives the plain torch engine here and DeepSpeed on GPUs (engines.py).
- **No logging inside.** No logging inside: the function returns `UpdateStats` (means over micro-batches
  weighted like the loss) and the caller logs them.
- **Settings from params.** The settings are read from params' `train` section as it is (`TrainConfig`:
  micro/mini batch sizes, ppo_epochs, bf16, and `train.loss` for the clips, KL and aggregation); no copy of
  its fields here.
- **Windowed trajectories.** A trajectory longer than the history window is encoded as several windows
  (sequences.py, decision "History windows"), each sequence carrying its trajectory's index (`source`). The
  trajectory stays the unit of the update: mini-batches are drawn over trajectories and take all their windows
  (`mini_batch_size` counts trajectories, so windows never add optimizer steps), and the `seq-mean-*`
  aggregations average over trajectories (a row of seq-mean-token-mean weighs its share of its trajectory's
  tokens, a row of the token-sum modes weighs 1). Micro-batches count sequences (they bound memory).
  With every trajectory in one sequence all of this reduces to the former per-sequence loop, draw
  for draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple, Protocol

import torch

from arpo_core.algorithm.losses import policy_loss
from arpo_core.config import TrainConfig
from arpo_core.policy.model import Policy
from arpo_core.policy.sequences import (
    EncodedSequence,
    collate,
    encode_trajectory_windows,
    sequence_logprobs,
)
from arpo_core.trajectory import Trajectory

__all__ = [
    "Engine",
    "UpdateStats",
    "compute_logps",
    "encode_trajectories",
    "ppo_update",
    "trajectory_units",
]


class Engine(Protocol):
    """What the update loop needs from a training engine (torch or DeepSpeed)."""

    model: torch.nn.Module
    accumulates: bool
    """Whether several backward calls may precede one step (false for DeepSpeed ZeRO-3, engines.py)."""
    module: torch.nn.Module
    """What forward passes must go through (DeepSpeed's wrapper gathers ZeRO-3 shards in its hooks)."""

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        """Accumulate gradients; `boundary` marks the last backward before `step()`."""
        ...

    def step(self) -> float:
        """Clip gradients, take one optimizer step, zero the gradients; return the pre-clip grad norm."""
        ...


class UpdateStats(NamedTuple):
    loss: float
    pg_loss: float
    clip_low_frac: float
    clip_high_frac: float
    clip_dual_frac: float
    approx_kl: float
    grad_norm: float
    """Mean pre-clip gradient norm over optimizer steps."""
    n_sequences: int
    n_tokens: int
    n_optimizer_steps: int
    ref_kl: float | None = None
    """Token-mean KL estimate to the reference policy (None without one)."""
    n_trajectories: int | None = None
    """Trajectories the sequences came from (decision "Windowed trajectories"; None: one sequence each)."""

    def as_metrics(self) -> dict[str, float]:
        extra = {"loss/ref_kl": self.ref_kl} if self.ref_kl is not None else {}
        return extra | {
            "loss/total": self.loss,
            "loss/policy": self.pg_loss,
            "clip/low_frac": self.clip_low_frac,
            "clip/high_frac": self.clip_high_frac,
            "clip/dual_frac": self.clip_dual_frac,
            "loss/approx_kl": self.approx_kl,
            "optim/grad_norm": self.grad_norm,
            "update/sequences": float(self.n_sequences),
            "update/trajectories": float(self.n_trajectories or self.n_sequences),
            "update/tokens": float(self.n_tokens),
            "update/optimizer_steps": float(self.n_optimizer_steps),
        }


def encode_trajectories(
    policy: Policy, trajs: Sequence[Trajectory], *, system: str, history_images: int | None
) -> list[EncodedSequence]:
    """The training sequences of `trajs` in order: one per trajectory, or its windows
    (decision "Windowed trajectories"), each with `source` = the index of its trajectory in `trajs`."""
    out: list[EncodedSequence] = []
    for i, t in enumerate(trajs):
        for seq in encode_trajectory_windows(policy, t, system=system, history_images=history_images):
            seq.source = i
            out.append(seq)
    return out


def trajectory_units(seqs: Sequence[EncodedSequence]) -> list[list[int]]:
    """The sequence indices of each trajectory, in order of first appearance
    (decision "Windowed trajectories")."""
    units: dict[object, list[int]] = {}
    for i, s in enumerate(seqs):
        units.setdefault(("own", i) if s.source is None else s.source, []).append(i)
    return list(units.values())


def _autocast(enabled: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else nullcontext()


def _forward(
    policy: Policy, seqs: Sequence[EncodedSequence], bf16: bool, module: torch.nn.Module | None = None
):
    batch = collate(seqs, policy.pad_id, policy.image_token_id, padding_side="right").to(policy.device)
    with _autocast(bf16, policy.device):
        logps, mask = sequence_logprobs(module or policy.model, batch)  # (B, T), (B, T)
    return logps.float(), mask


@torch.no_grad()
def compute_logps(
    policy: Policy,
    seqs: Sequence[EncodedSequence],
    *,
    micro_batch_size: int,
    bf16: bool,
    module: torch.nn.Module | None = None,
) -> list[torch.Tensor]:
    """Per-token log-probs of each sequence (unpadded, (L_i,) float32, 0 at position 0), in eval mode."""
    was_training = policy.model.training
    policy.model.eval()
    out: list[torch.Tensor] = []
    try:
        for i in range(0, len(seqs), micro_batch_size):
            chunk = seqs[i : i + micro_batch_size]
            logps, _ = _forward(policy, chunk, bf16, module)
            out.extend(logps[b, : len(s.input_ids)].cpu() for b, s in enumerate(chunk))
    finally:
        policy.model.train(was_training)
    return out


def _pad(rows: Sequence[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def ppo_update(
    policy: Policy,
    engine: Engine,
    seqs: Sequence[EncodedSequence],
    advantages: torch.Tensor,
    cfg: TrainConfig,
    *,
    seed: int,
    old_logps: Sequence[torch.Tensor] | None = None,
    ref_logps: Sequence[torch.Tensor] | None = None,
) -> UpdateStats:
    """Clipped policy-gradient steps on `seqs` with per-sequence `advantages` (N,) (the windows of one
    trajectory carry its advantage), with params' `train` settings `cfg` (decision "Settings from params");
    `seed` orders the mini-batches (decision "Seeded mini-batches"), which are drawn over trajectories
    (decision "Windowed trajectories").

    Sequences whose advantage is exactly 0 still count in the token-mean denominator (as in verl: they
    dilute the batch) but contribute no gradient; callers that want to skip them filter first.
    """
    n = len(seqs)
    if advantages.shape != (n,):
        raise ValueError(f"advantages must have shape ({n},), got {tuple(advantages.shape)}")
    if n == 0:
        return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)
    units = trajectory_units(seqs)
    # decision "Recomputed old log-probs"
    on_policy = old_logps is None and cfg.ppo_epochs == 1 and cfg.mini_batch_size >= len(units)
    if old_logps is None and not on_policy:
        old_logps = compute_logps(
            policy, seqs, micro_batch_size=cfg.micro_batch_size, bf16=cfg.bf16, module=engine.module
        )
    if not getattr(engine, "accumulates", True) and cfg.micro_batch_size < min(cfg.mini_batch_size, n):
        raise ValueError(
            "this engine cannot accumulate gradients over several backward calls (DeepSpeed ZeRO-3, see "
            "engines.py): set micro_batch_size >= mini_batch_size"
        )
    loss_cfg = cfg.loss
    if loss_cfg.kl_coef > 0 and ref_logps is None:
        raise ValueError("kl_coef > 0 needs ref_logps (log-probs of a reference policy)")
    n_masked = [sum(s.assistant_mask[1:]) for s in seqs]
    seq_weighted = loss_cfg.agg != "token-mean"
    # decision "Windowed trajectories": a row's weight in the seq-mean-* modes
    row_w = torch.ones(n)
    if loss_cfg.agg == "seq-mean-token-mean":
        for members in units:
            total = max(1, sum(n_masked[i] for i in members))
            for i in members:
                row_w[i] = n_masked[i] / total

    policy.model.train()
    gen = torch.Generator().manual_seed(seed)
    sums = dict.fromkeys(("loss", "pg", "low", "high", "dual", "kl", "ref_kl"), 0.0)
    grad_norms: list[float] = []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(units), generator=gen).tolist()
        for m0 in range(0, len(units), cfg.mini_batch_size):
            picked = order[m0 : m0 + cfg.mini_batch_size]
            mini = [i for u in picked for i in units[u]]
            denom = len(picked) if seq_weighted else max(1, sum(n_masked[i] for i in mini))
            for u0 in range(0, len(mini), cfg.micro_batch_size):
                micro = mini[u0 : u0 + cfg.micro_batch_size]
                logps, mask = _forward(policy, [seqs[i] for i in micro], cfg.bf16, engine.module)  # (B, T)
                T = logps.shape[1]
                old = logps.detach() if on_policy else _pad([old_logps[i] for i in micro], T).to(logps.device)
                ref = _pad([ref_logps[i] for i in micro], T).to(logps.device) if ref_logps else None
                out = policy_loss(
                    logps,
                    old,
                    advantages[micro].to(logps.device),
                    mask,
                    clip_low=loss_cfg.clip_low,
                    clip_high=loss_cfg.clip_high,
                    clip_dual=loss_cfg.clip_dual,
                    kl_coef=loss_cfg.kl_coef,
                    kl_estimator=loss_cfg.kl_estimator,
                    agg=loss_cfg.agg,
                    sum_norm=loss_cfg.sum_norm,
                    ref_logps=ref,
                    row_weights=row_w[micro] if seq_weighted else None,
                )
                w = (len(micro) if seq_weighted else sum(n_masked[i] for i in micro)) / denom
                engine.backward(out.loss * w, boundary=u0 + cfg.micro_batch_size >= len(mini))
                sums["loss"] += float(out.loss.detach()) * w
                sums["pg"] += float(out.pg_loss) * w
                sums["low"] += float(out.clip_low_frac) * w
                sums["high"] += float(out.clip_high_frac) * w
                sums["dual"] += float(out.clip_dual_frac) * w
                sums["kl"] += float(out.approx_kl) * w
                if out.kl is not None:
                    sums["ref_kl"] += float(out.kl) * w
            grad_norms.append(engine.step())
    steps = len(grad_norms)
    return UpdateStats(
        loss=sums["loss"] / steps,
        pg_loss=sums["pg"] / steps,
        clip_low_frac=sums["low"] / steps,
        clip_high_frac=sums["high"] / steps,
        clip_dual_frac=sums["dual"] / steps,
        approx_kl=sums["kl"] / steps,
        grad_norm=sum(grad_norms) / steps,
        n_sequences=n,
        n_tokens=sum(n_masked),
        n_optimizer_steps=steps,
        ref_kl=sums["ref_kl"] / steps if ref_logps is not None else None,
        n_trajectories=len(units),
    )
