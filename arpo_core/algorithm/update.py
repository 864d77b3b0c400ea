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
- **Global normalisation.** Across data-parallel ranks (distributed.py, decisions "Split by trajectory",
  "Summed gradients" and "ZeRO-3 lockstep"): with a `Shard` each rank holds some trajectories of the batch,
  named by their global index. Every rank draws the same order over ALL trajectories and trains, per mini-
  batch, on those it holds; the loss denominator is the whole mini-batch's (token-mean: its masked tokens
  summed over ranks, one all-reduce for every mini-batch of the update up front; seq-mean modes: its
  trajectory count, known to every rank), and the engine sums the gradients over ranks, so R ranks give the
  one-process gradient. An engine that reduces inside the backward (DeepSpeed) needs every rank to call it the
  same number of times: a rank with fewer micro-batches in a mini-batch runs zero-weight passes over one of
  its own sequences (or a padding one, global index -1) until it has as many as the busiest rank; under ZeRO-3
  the old log-prob passes are padded the same way, since every ZeRO-3 forward is a collective. The returned
  statistics are summed over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple, Protocol

import torch

from arpo_core.algorithm.distributed import Ranks
from arpo_core.algorithm.losses import policy_loss
from arpo_core.config import TrainConfig
from arpo_core.policy.model import Policy
from arpo_core.policy.prompt import PromptSpec
from arpo_core.policy.sequences import (
    EncodedSequence,
    collate,
    encode_trajectory_windows,
    sequence_logprobs,
)
from arpo_core.trajectory import Trajectory

__all__ = [
    "Engine",
    "Shard",
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


class Shard(NamedTuple):
    """Decision "Global normalisation": this rank's part of an update spread over data-parallel ranks."""

    ranks: Ranks
    unit_ids: Sequence[int]
    """The global index of each local trajectory (in the order of the local sequences' trajectories);
    -1 marks a padding trajectory that only serves zero-weight passes."""
    n_units: int
    """Trajectories over all ranks."""


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
    policy: Policy, trajs: Sequence[Trajectory], *, spec: PromptSpec
) -> list[EncodedSequence]:
    """The training sequences of `trajs` in order: one per trajectory, or its windows
    (decision "Windowed trajectories"), each with `source` = the index of its trajectory in `trajs`."""
    out: list[EncodedSequence] = []
    for i, t in enumerate(trajs):
        for seq in encode_trajectory_windows(policy, t, spec=spec):
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
    pad_to: int = 0,
) -> list[torch.Tensor]:
    """Per-token log-probs of each sequence (unpadded, (L_i,) float32, 0 at position 0), in eval mode.
    `pad_to`: run at least that many forwards (zero-work repeats of the first chunk; the lockstep of decision
    "Global normalisation"
    under ZeRO-3, where every forward is a collective); it needs at least one sequence."""
    was_training = policy.model.training
    policy.model.eval()
    out: list[torch.Tensor] = []
    calls = 0
    try:
        for i in range(0, len(seqs), micro_batch_size):
            chunk = seqs[i : i + micro_batch_size]
            logps, _ = _forward(policy, chunk, bf16, module)
            out.extend(logps[b, : len(s.input_ids)].cpu() for b, s in enumerate(chunk))
            calls += 1
        while calls < pad_to:
            _forward(policy, seqs[:1], bf16, module)
            calls += 1
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
    shard: Shard | None = None,
) -> UpdateStats:
    """Clipped policy-gradient steps on `seqs` with per-sequence `advantages` (N,) (the windows of one
    trajectory carry its advantage), with params' `train` settings `cfg` (decision "Settings from params");
    `seed` orders the mini-batches (decision "Seeded mini-batches"), which are drawn over trajectories
    (decision "Windowed trajectories"). With `shard`, `seqs` are this rank's part of a batch spread over
    data-parallel ranks (decision "Global normalisation").

    Sequences whose advantage is exactly 0 still count in the token-mean denominator (as in verl: they
    dilute the batch) but contribute no gradient; callers that want to skip them filter first.
    """
    n = len(seqs)
    if advantages.shape != (n,):
        raise ValueError(f"advantages must have shape ({n},), got {tuple(advantages.shape)}")
    units = trajectory_units(seqs)
    ranks = shard.ranks if shard is not None else None
    if shard is None:
        global_ids: Sequence[int] = range(len(units))
        n_units = len(units)
    else:
        if len(shard.unit_ids) != len(units):
            raise ValueError(f"{len(shard.unit_ids)} unit ids for {len(units)} local trajectories")
        global_ids, n_units = shard.unit_ids, shard.n_units
    if n_units == 0:
        return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)
    local_of = {g: k for k, g in enumerate(global_ids) if g >= 0}
    lockstep = ranks is not None and ranks.distributed and getattr(engine, "reduces_in_backward", False)
    lockstep_forward = lockstep and getattr(engine, "gathers_in_forward", False)
    # decision "Recomputed old log-probs"
    on_policy = old_logps is None and cfg.ppo_epochs == 1 and cfg.mini_batch_size >= n_units
    if old_logps is None and not on_policy:
        pad = 0
        if (
            lockstep_forward
        ):  # decision "Global normalisation": as many old-log-prob forwards as the busiest rank
            calls = torch.tensor([float(math.ceil(n / cfg.micro_batch_size))])
            pad = int(ranks.all_reduce_max(calls)[0])  # type: ignore[union-attr]
        old_logps = compute_logps(
            policy,
            seqs,
            micro_batch_size=cfg.micro_batch_size,
            bf16=cfg.optimizer.bf16,
            module=engine.module,
            pad_to=pad,
        )
    if not getattr(engine, "accumulates", True) and cfg.micro_batch_size < min(cfg.mini_batch_size, n_units):
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

    # The plan: every ppo epoch's order over ALL trajectories, cut into mini-batches; per mini-batch
    # the local sequences, its denominator (decision "Global normalisation") and how many micro-batch passes
    # every rank runs.
    gen = torch.Generator().manual_seed(seed)
    plan: list[tuple[list[int], int]] = []  # (local sequence indices, global trajectories in it)
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n_units, generator=gen).tolist()
        for m0 in range(0, n_units, cfg.mini_batch_size):
            picked = order[m0 : m0 + cfg.mini_batch_size]
            mini = [i for g in picked if g in local_of for i in units[local_of[g]]]
            plan.append((mini, len(picked)))
    if seq_weighted:
        denoms = [float(k) for _, k in plan]
    else:
        local_tokens = torch.tensor([float(sum(n_masked[i] for i in mini)) for mini, _ in plan])
        total = ranks.all_reduce_sum(local_tokens) if ranks is not None else local_tokens
        denoms = [max(1.0, float(x)) for x in total]
    passes = [math.ceil(len(mini) / cfg.micro_batch_size) for mini, _ in plan]
    if lockstep:
        passes = [int(x) for x in ranks.all_reduce_max(torch.tensor([float(c) for c in passes]))]  # type: ignore[union-attr]
    if any(c > 0 for c in passes) and n == 0:
        raise ValueError("this rank holds no sequence for its zero-weight passes (give it a padding one)")

    policy.model.train()
    sums = dict.fromkeys(("loss", "pg", "low", "high", "dual", "kl", "ref_kl"), 0.0)
    grad_norms: list[float] = []
    for (mini, _), denom, n_pass in zip(plan, denoms, passes, strict=True):
        for j in range(n_pass):
            micro = mini[j * cfg.micro_batch_size : (j + 1) * cfg.micro_batch_size]
            boundary = j == n_pass - 1
            if (
                not micro
            ):  # decision "Global normalisation": a zero-weight pass keeps this rank in step with the others
                logps, _ = _forward(policy, seqs[:1], cfg.optimizer.bf16, engine.module)
                engine.backward(logps.sum() * 0.0, boundary=boundary)
                continue
            logps, mask = _forward(
                policy, [seqs[i] for i in micro], cfg.optimizer.bf16, engine.module
            )  # (B, T)
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
            engine.backward(out.loss * w, boundary=boundary)
            sums["loss"] += float(out.loss.detach()) * w
            sums["pg"] += float(out.pg_loss) * w
            sums["low"] += float(out.clip_low_frac) * w
            sums["high"] += float(out.clip_high_frac) * w
            sums["dual"] += float(out.clip_dual_frac) * w
            sums["kl"] += float(out.approx_kl) * w
            if out.kl is not None:
                sums["ref_kl"] += float(out.kl) * w
        grad_norms.append(engine.step())
    keys = list(sums)
    real = [i for k, g in enumerate(global_ids) if g >= 0 for i in units[k]]  # padding left out
    counts = [float(len(real)), float(sum(n_masked[i] for i in real))]
    if (
        ranks is not None and ranks.distributed
    ):  # decision "Global normalisation": the batch's statistics, all ranks together
        reduced = ranks.all_reduce_sum(torch.tensor([sums[k] for k in keys] + counts, dtype=torch.float64))
        sums = {k: float(v) for k, v in zip(keys, reduced[: len(keys)], strict=True)}
        counts = [float(x) for x in reduced[len(keys) :]]
    steps = len(grad_norms)
    return UpdateStats(
        loss=sums["loss"] / steps,
        pg_loss=sums["pg"] / steps,
        clip_low_frac=sums["low"] / steps,
        clip_high_frac=sums["high"] / steps,
        clip_dual_frac=sums["dual"] / steps,
        approx_kl=sums["kl"] / steps,
        grad_norm=sum(grad_norms) / steps,
        n_sequences=int(counts[0]),
        n_tokens=int(counts[1]),
        n_optimizer_steps=steps,
        ref_kl=sums["ref_kl"] / steps if ref_logps is not None else None,
        n_trajectories=n_units,
    )
