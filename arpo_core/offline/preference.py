"""Offline baselines from stored rollouts: rejection-sampling fine-tuning (RFT), DPO and KTO.

The ARPO paper compares online RL with these offline methods trained on the base policy's rollouts
(docs/method.md §4: rejection sampling 21.8, DPO 22.4, KTO 24.6, GRPO 26.0, ARPO 27.3 on OSWorld).

Decisions:
- **RL sequences.** Same sequences as RL: one multi-turn trajectory = one token sequence with its screenshots
  (or its windows, when it is longer than the history window: `policy/sequences.py`,
  decision "History windows"), and a trajectory's log-probability is the SUM of its per-token log-probs over
  the assistant mask (`policy.sequences.sequence_logprobs`; replies + `<|im_end|>`), the quantity DPO and KTO
  are defined on (TRL's `get_batch_logps(average_log_prob=False)`).
- **Base reference model.** Reference model = the base policy, i.e. the policy as passed in, before the first
  step. Its sequence log-prob sums are computed once up front (eval mode, no grad), as TRL does with
  `precompute_ref_log_probs`, so no second model copy is kept in memory.
- **DPO sigmoid loss.** DPO: the sigmoid loss of Rafailov et al. (2023), eq. 7, with optional conservative
  label smoothing (cDPO), exactly TRL's `dpo_loss` for `loss_type="sigmoid"` (huggingface/trl,
  trl/trainer/dpo_trainer.py): logits = (pi_c - pi_r) - (ref_c - ref_r),
  loss = -(1 - eps) log sigma(beta logits) - eps log sigma(-beta logits), averaged over pairs; implicit
  rewards beta (pi - ref).
- **DPO pairs.** DPO pairs: chosen = a trajectory of the task with success > `success_threshold` (strictly, as
  selection.py and replay.py count a success), rejected = one of the SAME task (key (domain, id)) at
  or below it. When a task has s successes and f failures it gives
  max(s, f) pairs (capped by `max_pairs_per_task`): both lists are shuffled (seeded) and the shorter
  one is cycled, so every trajectory of the task is used at least once and no pair repeats. A task
  with only successes or only failures gives no pair (DPO needs a contrast), and is counted.
- **KTO loss.** KTO: Ethayarajh et al. (2024), eq. 7, as TRL's `kto_loss` (huggingface/trl,
  trl/trainer/kto_trainer.py): desirable loss 1 - sigma(beta (r - z0)), undesirable loss
  1 - sigma(beta (z0 - r)), r = pi - ref, weighted by desirable/undesirable weights and averaged over
  the batch. The reference point z0 is TRL's: the batch mean of pi - ref over MISMATCHED pairs (the
  prompt of one example with the completion of another), detached and clamped at 0. TRL builds those
  pairs once, at dataset construction (`_get_kl_dataset`: completions rotated by one inside each
  batch); here each trajectory gets one fixed partner (a seeded rotation that prefers a partner of
  another task, because another sample of the same task is a valid answer to the same prompt and
  would not measure divergence). A multi-turn mismatched pair is the instruction and screenshots of
  trajectory i with the replies of its partner j, truncated to the shorter of the two. Fixed partners
  let the reference side of z0 be precomputed once too (decision "Base reference model").
- **KTO class weights.** KTO class weights: TRL advises weights such that desirable_weight * n_D /
  (undesirable_weight * n_U) lies in [1, 4/3]; with `balance=True` the configured weights are scaled into that
  range (`kto_class_weights`), because base-policy rollouts are usually mostly failures.
- **RFT as cloning.** RFT = behaviour cloning (`behaviour_cloning.sft`, unchanged) on the successful
  trajectories only, at most `max_per_task` per task so that easy tasks do not dominate.
- **Training loops.** Training loops: `batch_size` pairs (DPO) or examples (KTO) per optimizer step,
  micro-batches of `micro_batch_size` weighted by their share of the batch so the step equals one big batch;
  batches are drawn by reshuffling every pass (seeded); an `Engine` (engines.py) does backward and step, so
  DeepSpeed works as for GRPO. Trajectories are encoded per micro-batch (pixel tensors of all of them
  would not fit in memory at scale, see behaviour_cloning.py). Nothing is logged; each loop returns one
  metrics dict per optimizer step.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from arpo_core.algorithm.engines import make_engine
from arpo_core.algorithm.update import Engine
from arpo_core.config.sections import DPOConfig, KTOConfig, RFTConfig
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.offline.behaviour_cloning import sft
from arpo_core.policy.model import Policy
from arpo_core.policy.prompt import PromptSpec
from arpo_core.policy.sequences import (
    EncodedSequence,
    collate,
    encode_trajectory_windows,
    sequence_logprobs,
)
from arpo_core.trajectory import Step, Trajectory

__all__ = [
    "DPOConfig",
    "DPOOutput",
    "KTOConfig",
    "KTOOutput",
    "PreferenceResult",
    "RFTConfig",
    "dpo",
    "dpo_loss",
    "dpo_pairs",
    "kl_partners",
    "kto",
    "kto_class_weights",
    "kto_loss",
    "kto_reference_point",
    "mismatched_trajectory",
    "rft",
    "rft_select",
    "sequence_logp_sums",
]


# --------------------------------------------------------------------------------------------------
# Configs


# --------------------------------------------------------------------------------------------------
# Pure losses


def sequence_logp_sums(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token log-probs over the assistant mask: logps (B, T), mask (B, T) bool -> (B,)."""
    return (logps * mask).sum(-1)


class DPOOutput(NamedTuple):
    loss: torch.Tensor
    """Scalar: mean over pairs."""
    chosen_rewards: torch.Tensor
    """(P,) beta (pi_c - ref_c), detached."""
    rejected_rewards: torch.Tensor
    """(P,) beta (pi_r - ref_r), detached."""
    margin: torch.Tensor
    """Scalar: mean of chosen_rewards - rejected_rewards."""
    accuracy: torch.Tensor
    """Scalar: fraction of pairs whose chosen reward exceeds the rejected one."""


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float,
) -> DPOOutput:
    """Sigmoid DPO loss on sequence log-prob sums, all (P,) (decision "DPO sigmoid loss")."""
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)  # (P,)
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    )
    chosen = (beta * (policy_chosen_logps - ref_chosen_logps)).detach()
    rejected = (beta * (policy_rejected_logps - ref_rejected_logps)).detach()
    return DPOOutput(
        losses.mean(), chosen, rejected, (chosen - rejected).mean(), (chosen > rejected).float().mean()
    )


class KTOOutput(NamedTuple):
    loss: torch.Tensor
    """Scalar: mean over the batch of the weighted per-example losses."""
    losses: torch.Tensor
    """(N,) weighted per-example losses, in input order."""
    rewards: torch.Tensor
    """(N,) beta (pi - ref), detached."""
    kl: torch.Tensor
    """Scalar: the reference point z0 (detached, >= 0)."""


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> KTOOutput:
    """KTO loss (decision "KTO loss"). policy_logps, ref_logps (N,) sequence sums; desirable (N,) bool; kl the
    reference point z0 from `kto_reference_point`."""
    kl = kl.detach()
    logratios = policy_logps - ref_logps  # (N,)
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))),
    )
    return KTOOutput(losses.mean(), losses, (beta * logratios).detach(), kl)


def kto_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean(pi - ref)) over mismatched pairs (M,), detached (TRL's KL estimate)."""
    return (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_class_weights(n_desirable: int, n_undesirable: int) -> tuple[float, float]:
    """Multipliers (for lambda_D, lambda_U) putting lambda_D n_D / (lambda_U n_U) into [1, 4/3]
    (decision "KTO class weights"). The weights are only ever raised, never lowered."""
    if n_desirable <= 0 or n_undesirable <= 0:
        return (1.0, 1.0)
    if n_desirable < n_undesirable:
        return (n_undesirable / n_desirable, 1.0)
    if n_desirable > 4 / 3 * n_undesirable:
        return (1.0, n_desirable / (4 / 3 * n_undesirable))
    return (1.0, 1.0)


# --------------------------------------------------------------------------------------------------
# Data: pairs, partners, selections


def _by_task(trajs: Sequence[Trajectory]) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        out[t.key].append(i)
    return out


def dpo_pairs(
    trajs: Sequence[Trajectory],
    success_threshold: float,
    max_pairs_per_task: int | None = None,
    seed: int = 0,
) -> tuple[list[tuple[int, int]], int]:
    """(chosen index, rejected index) pairs within each task (decision "DPO pairs"), and the number of tasks
    that gave no pair because all their trajectories succeeded or all failed."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    unpaired = 0
    groups = _by_task(trajs)
    for key in sorted(groups):
        wins = [i for i in groups[key] if trajs[i].success > success_threshold]
        losses = [i for i in groups[key] if trajs[i].success <= success_threshold]
        if not wins or not losses:
            unpaired += 1
            continue
        rng.shuffle(wins)
        rng.shuffle(losses)
        n = max(len(wins), len(losses))
        if max_pairs_per_task is not None:
            n = min(n, max_pairs_per_task)
        pairs.extend((wins[k % len(wins)], losses[k % len(losses)]) for k in range(n))
    return pairs, unpaired


def kl_partners(trajs: Sequence[Trajectory], seed: int = 0) -> list[int]:
    """For each trajectory i the index j != i of its KL partner (decision "KTO loss"): a seeded rotation of a
    shuffled order, skipping ahead to the first trajectory of another task when there is one."""
    n = len(trajs)
    if n < 2:
        raise ValueError("KTO's reference point needs at least 2 trajectories")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    out = [0] * n
    for p, i in enumerate(order):
        j = order[(p + 1) % n]
        for s in range(1, n):
            cand = order[(p + s) % n]
            if trajs[cand].key != trajs[i].key:
                j = cand
                break
        out[i] = j
    return out


def mismatched_trajectory(x: Trajectory, y: Trajectory) -> Trajectory:
    """The prompt side (instruction, screenshots) of `x` with the replies of `y`, truncated to the
    shorter of the two (decision "KTO loss")."""
    steps = [
        Step(
            step_idx=k,
            screenshot_png=sx.screenshot_png,
            screen_w=sx.screen_w,
            screen_h=sx.screen_h,
            response_text=sy.response_text,
            response_token_ids=list(sy.response_token_ids),
        )
        for k, (sx, sy) in enumerate(zip(x.steps, y.steps, strict=False))
    ]
    return x.with_(steps=steps, success=0.0, reward=0.0)


def rft_select(
    trajs: Sequence[Trajectory],
    success_threshold: float,
    max_per_task: int | None = None,
    seed: int = 0,
) -> list[Trajectory]:
    """The successful trajectories, at most `max_per_task` per task (a seeded choice), in input order."""
    rng = random.Random(seed)
    keep: list[int] = []
    groups = _by_task(trajs)
    for key in sorted(groups):
        wins = [i for i in groups[key] if trajs[i].success > success_threshold]
        if max_per_task is not None and len(wins) > max_per_task:
            wins = rng.sample(wins, max_per_task)
        keep.extend(wins)
    return [trajs[i] for i in sorted(keep)]


# --------------------------------------------------------------------------------------------------
# Training loops


@dataclass
class PreferenceResult:
    history: list[dict[str, float]]
    """One metrics dict per optimizer step."""
    n_examples: int
    """DPO: pairs; KTO: trajectories."""
    n_skipped_tasks: int = 0
    """DPO: tasks without both a success and a failure."""
    info: dict[str, float] = field(default_factory=dict)
    """Run-level numbers (class counts, effective weights)."""


def _autocast(enabled: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else nullcontext()


def _logp_sums(
    policy: Policy, module: torch.nn.Module, trajs: Sequence[Sequence[EncodedSequence]], bf16: bool
) -> torch.Tensor:
    """Trajectory log-prob sums (B,) of one padded forward through `module` (with grad if enabled); each
    trajectory is its sequences (one, or its windows: decision "RL sequences")."""
    seqs = [s for windows in trajs for s in windows]
    owner = torch.tensor([b for b, windows in enumerate(trajs) for _ in windows], device=policy.device)
    batch = collate(seqs, policy.pad_id, policy.image_token_id, padding_side="right").to(policy.device)
    with _autocast(bf16, policy.device):
        logps, mask = sequence_logprobs(module, batch)  # (S, T), (S, T)
    rows = sequence_logp_sums(logps.float(), mask)  # (S,)
    return torch.zeros(len(trajs), dtype=rows.dtype, device=rows.device).index_add(0, owner, rows)


@torch.no_grad()
def _reference_sums(
    policy: Policy,
    module: torch.nn.Module,
    trajs: Sequence[Trajectory],
    encode: Callable[[Trajectory], list[EncodedSequence]],
    bf16: bool,
    chunk: int,
) -> torch.Tensor:
    """Sequence log-prob sums (N,) of the policy as it is now (the reference,
    decision "Base reference model"), eval mode."""
    was_training = policy.model.training
    policy.model.eval()
    out = []
    try:
        for i in range(0, len(trajs), chunk):
            seqs = [encode(t) for t in trajs[i : i + chunk]]
            out.append(_logp_sums(policy, module, seqs, bf16).cpu())
    finally:
        policy.model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def _encoder(policy: Policy, spec: PromptSpec) -> Callable[[Trajectory], list[EncodedSequence]]:
    return lambda t: encode_trajectory_windows(policy, t, spec=spec)


def _batches(n: int, size: int, seed: int) -> Callable[[], list[int]]:
    """Draws `size` indices per call from a reshuffled-every-pass order (behaviour_cloning.py,
    decision "Seeded batches")."""
    rng = random.Random(seed)
    order: list[int] = []

    def draw() -> list[int]:
        out = []
        while len(out) < size:
            if not order:
                order.extend(range(n))
                rng.shuffle(order)
            out.append(order.pop())
        return out

    return draw


def _make_engine(policy: Policy, engine: Engine | None, cfg: DPOConfig | KTOConfig) -> Engine:
    if engine is not None:
        if not getattr(engine, "accumulates", True) and cfg.micro_batch_size < cfg.batch_size:
            raise ValueError(
                "this engine cannot accumulate gradients over several backward calls (DeepSpeed "
                "ZeRO-3, engines.py): set micro_batch_size >= batch_size"
            )
        return engine
    return make_engine("torch", policy.model, cfg.optimizer)


def _save(policy: Policy, out: Path, state: dict) -> None:
    policy.save(out)
    atomic_write_json(out / "preference_state.json", state, indent=1)


def dpo(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    config: DPOConfig,
    *,
    success_threshold: float,
    spec: PromptSpec,
    engine: Engine | None = None,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
) -> PreferenceResult:
    """Train `policy` in place with DPO on pairs of `trajectories` (decisions "Base reference model",
    "DPO sigmoid loss", "DPO pairs" and "Training loops").

    Returns per-step metrics: loss/dpo, rewards/chosen, rewards/rejected, rewards/margin,
    rewards/accuracy, optim/grad_norm. The final policy goes to `checkpoint_dir/final/` if given.
    """
    pairs, unpaired = dpo_pairs(trajectories, success_threshold, config.max_pairs_per_task, config.seed)
    if not pairs:
        raise ValueError(
            "DPO found no task with both a success and a failure "
            f"(success_threshold={success_threshold}, {len(trajectories)} trajectories)"
        )
    engine = _make_engine(policy, engine, config)
    encode = _encoder(policy, spec)
    used = sorted({i for p in pairs for i in p})
    ref_all = _reference_sums(
        policy,
        engine.module,
        [trajectories[i] for i in used],
        encode,
        config.optimizer.bf16,
        2 * config.micro_batch_size,
    )
    ref = dict(zip(used, ref_all.tolist(), strict=True))
    draw = _batches(len(pairs), config.batch_size, config.seed)
    history: list[dict[str, float]] = []
    policy.model.train()
    for _ in tqdm(range(config.steps), desc="dpo", disable=not progress):
        batch = [pairs[k] for k in draw()]
        sums = dict.fromkeys(("loss", "chosen", "rejected", "margin", "acc"), 0.0)
        for u0 in range(0, len(batch), config.micro_batch_size):
            micro = batch[u0 : u0 + config.micro_batch_size]
            P = len(micro)
            seqs = [encode(trajectories[c]) for c, _ in micro]
            seqs += [encode(trajectories[r]) for _, r in micro]
            pol = _logp_sums(policy, engine.module, seqs, config.optimizer.bf16)  # (2P,)
            dev = pol.device
            ref_c = torch.tensor([ref[c] for c, _ in micro], device=dev)
            ref_r = torch.tensor([ref[r] for _, r in micro], device=dev)
            out = dpo_loss(pol[:P], pol[P:], ref_c, ref_r, config.beta, config.label_smoothing)
            # the step's loss is the mean over all pairs of the batch (decision "Training loops")
            w = P / len(batch)
            engine.backward(out.loss * w, boundary=u0 + config.micro_batch_size >= len(batch))
            sums["loss"] += float(out.loss.detach()) * w
            sums["chosen"] += float(out.chosen_rewards.mean()) * w
            sums["rejected"] += float(out.rejected_rewards.mean()) * w
            sums["margin"] += float(out.margin) * w
            sums["acc"] += float(out.accuracy) * w
        grad_norm = engine.step()
        history.append(
            {
                "loss/dpo": sums["loss"],
                "rewards/chosen": sums["chosen"],
                "rewards/rejected": sums["rejected"],
                "rewards/margin": sums["margin"],
                "rewards/accuracy": sums["acc"],
                "optim/grad_norm": grad_norm,
            }
        )
    policy.model.eval()
    if checkpoint_dir is not None:
        _save(
            policy,
            Path(checkpoint_dir) / "final",
            {"method": "dpo", "config": asdict(config), "history": history},
        )
    return PreferenceResult(history, len(pairs), unpaired, {"dpo/pairs": float(len(pairs))})


def kto(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    config: KTOConfig,
    *,
    success_threshold: float,
    spec: PromptSpec,
    engine: Engine | None = None,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
) -> PreferenceResult:
    """Train `policy` in place with KTO on desirable / undesirable `trajectories`
    (decisions "Base reference model", "KTO loss", "KTO class weights" and "Training loops").

    Returns per-step metrics: loss/kto, kto/kl (the reference point z0), rewards/desirable and
    rewards/undesirable (mean implicit reward of each class in the batch, when present),
    optim/grad_norm. The final policy goes to `checkpoint_dir/final/` if given.
    """
    n = len(trajectories)
    if config.batch_size < 2:
        raise ValueError("KTO needs batch_size >= 2 (the reference point is a batch mean)")
    desirable = torch.tensor([t.success > success_threshold for t in trajectories], dtype=torch.bool)
    n_d = int(desirable.sum())
    mult_d, mult_u = kto_class_weights(n_d, n - n_d) if config.balance else (1.0, 1.0)
    w_d, w_u = config.desirable_weight * mult_d, config.undesirable_weight * mult_u
    partners = kl_partners(trajectories, config.seed)
    mism = [mismatched_trajectory(trajectories[i], trajectories[j]) for i, j in enumerate(partners)]
    engine = _make_engine(policy, engine, config)
    encode = _encoder(policy, spec)
    ref = _reference_sums(
        policy, engine.module, trajectories, encode, config.optimizer.bf16, config.micro_batch_size
    )
    ref_kl = _reference_sums(
        policy, engine.module, mism, encode, config.optimizer.bf16, config.micro_batch_size
    )
    draw = _batches(n, config.batch_size, config.seed)
    history: list[dict[str, float]] = []
    policy.model.train()
    for _ in tqdm(range(config.steps), desc="kto", disable=not progress):
        batch = draw()
        # z0 of this batch: policy on the batch's mismatched pairs, no grad (TRL does the same).
        with torch.no_grad():
            pol_kl = torch.cat(
                [
                    _logp_sums(policy, engine.module, [encode(mism[i]) for i in micro], config.optimizer.bf16)
                    for micro in _chunks(batch, config.micro_batch_size)
                ]
            )
        z0 = kto_reference_point(pol_kl.cpu(), ref_kl[batch])
        loss_sum = 0.0
        rewards = torch.zeros(len(batch))
        for u0 in range(0, len(batch), config.micro_batch_size):
            micro = batch[u0 : u0 + config.micro_batch_size]
            pol = _logp_sums(
                policy, engine.module, [encode(trajectories[i]) for i in micro], config.optimizer.bf16
            )
            dev = pol.device
            out = kto_loss(
                pol, ref[micro].to(dev), desirable[micro].to(dev), z0.to(dev), config.beta, w_d, w_u
            )
            w = len(micro) / len(batch)
            engine.backward(out.loss * w, boundary=u0 + config.micro_batch_size >= len(batch))
            loss_sum += float(out.loss.detach()) * w
            rewards[u0 : u0 + len(micro)] = out.rewards.cpu()
        grad_norm = engine.step()
        labels = desirable[batch]
        row = {"loss/kto": loss_sum, "kto/kl": float(z0), "optim/grad_norm": grad_norm}
        if labels.any():
            row["rewards/desirable"] = float(rewards[labels].mean())
        if (~labels).any():
            row["rewards/undesirable"] = float(rewards[~labels].mean())
        history.append(row)
    policy.model.eval()
    if checkpoint_dir is not None:
        _save(
            policy,
            Path(checkpoint_dir) / "final",
            {"method": "kto", "config": asdict(config), "history": history},
        )
    info = {
        "kto/desirable": float(n_d),
        "kto/undesirable": float(n - n_d),
        "kto/desirable_weight": w_d,
        "kto/undesirable_weight": w_u,
    }
    return PreferenceResult(history, n, 0, info)


def _chunks(xs: list[int], size: int) -> list[list[int]]:
    return [xs[i : i + size] for i in range(0, len(xs), size)]


def rft(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    config: RFTConfig,
    *,
    success_threshold: float,
    spec: PromptSpec,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
) -> list[float]:
    """Rejection-sampling fine-tuning: `behaviour_cloning.sft` on the successes (decision "RFT as cloning");
    returns its losses."""
    kept = rft_select(trajectories, success_threshold, config.max_per_task, config.seed)
    if not kept:
        raise ValueError(
            f"RFT found no trajectory with success > {success_threshold} among {len(trajectories)}"
        )
    return sft(
        policy,
        kept,
        config.sft,
        checkpoint_dir=checkpoint_dir,
        progress=progress,
        spec=spec,
    )
