"""Offline training on stored trajectories. First part: supervised fine-tuning (behaviour cloning).

Decisions:
- **Token-mean NLL.** The loss is the mean negative log-likelihood of the assistant tokens (reply +
  `<|im_end|>`), over all assistant tokens of the accumulated batch (token-mean, so long replies weigh by
  their length), with the same sequences and forward as RL (`policy/sequences.py`): what BC trains is what
  GRPO later scores, M-RoPE positions included.
- **Seeded batches.** Batches are drawn by shuffling the trajectories every epoch with a seeded
  `random.Random`; an optimizer step takes `batch_size * grad_accum` trajectories in `grad_accum`
  micro-batches.
- **Optional bf16 autocast.** bf16 autocast on CPU is optional (about 2x faster on this machine kind,
  docs/method.md §6); weights and optimizer state stay fp32.
- **Policy checkpoints.** Every `checkpoint_every` optimizer steps (and at the end, when a checkpoint dir is
  given) the policy is written with `save_pretrained` beside `optimizer.pt` and `sft_state.json` (step, loss
  history), so a checkpoint is a normal policy directory loadable by `load_policy`.
- **Returns loss history.** The function returns the loss history; it logs nothing (arpo_core is a library). A
  tqdm bar shows progress unless disabled.
- **Cloned replies.** What is cloned: every reply of a trajectory, each conditioned on exactly the context the
  policy has at that step of a rollout (the earlier replies and the screenshots of the history window; one
  sequence per window when the episode is longer than the window, `sequences.py`, decision "History windows"),
  and the loss covers the replies of the steps with `train_reply` set. The steps without it are a recovery
  demo's deliberate misses (arpo_core/offline/demonstrations.py, decisions "Recovery demos" and
  "Untrained misses"): context the policy must learn to answer after, never a behaviour to imitate. A
  trajectory set with no trainable reply at all is an error.
- **Length-sorted forwards.** A batch of `batch_size` trajectories can hold more sequences than that (their
  windows, decision "Cloned replies"). Its sequences are sorted by length and cut into equal parts of at most
  `batch_size` rows, one forward each: a forward never holds more rows than before windows (peak memory), and
  rows of similar length pad less (measured on the main job's demos at K = 1: 72 % of the padded tokens real
  in one forward, 85 % in two sorted ones). The loss stays the token-mean of the step
  (decision "Token-mean NLL").
- **Pointing loss.** With `point_weight` > 0 the step adds the ground stage's pointing loss
  (arpo_core/offline/grounding.py, decision "Pointing loss") on the demos: at the two positions of each
  trained click that predict the first character of x and of y, the first `point_heads` heads of the last
  layer are taught to put their mass on the merged image token whose cell holds the demo's click, on the
  screenshot the reply answers (`heads.click_targets`). The oracle clicks the centre of the element it
  means, so that cell is the target's; no field is added to the trajectories. The ground stage teaches
  the head on instructions that name one target; the demos' name several in an order ("Select a, b and
  click Submit"), where the head read one fixed cell (docs/results.md, "The readout in the main job").
  Measured over six cloning seeds, the loss raised click-button (one named target) in all six and
  lowered click-checkboxes (several, in an order) in five; `point_one_click` teaches it only in demos whose
  trained replies click once (`clicks`), and clones the others without it; measured, click-checkboxes fell
  all the same (docs/results.md, "The pointing loss only where the demo clicks once").
  The term is the mean over heads and positions of the accumulated batch, weighted by `point_weight`;
  its history is returned beside the cloning loss's (`point_history`).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from contextlib import nullcontext, suppress
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from arpo_core.actions import ActionParseError, parse_response
from arpo_core.config.sections import SFTConfig
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.policy.heads import HeadWeights, click_targets
from arpo_core.policy.model import Policy
from arpo_core.policy.prompt import PromptSpec
from arpo_core.policy.sequences import collate, encode_trajectory_windows, sequence_logprobs
from arpo_core.trajectory import Trajectory

__all__ = ["SFTConfig", "lr_factor", "masked_mean_nll", "sft"]


def lr_factor(step: int, warmup: int, total: int, min_frac: float) -> float:
    """Warm-up then cosine schedule: factor of the peak LR at 0-based `step`.

    >>> [round(lr_factor(s, 2, 6, 0.0), 3) for s in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.25, 0.0]
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup - 1)
    t = min(1.0, (step - warmup) / span)
    return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t))


def masked_mean_nll(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood: logps (B, T), mask (B, T) bool -> scalar. 0 if mask is empty."""
    n = mask.sum()
    return -(logps * mask).sum() / n.clamp(min=1)


def _save(policy: Policy, optimizer: torch.optim.Optimizer, out: Path, state: dict) -> None:
    policy.save(out)
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    atomic_write_json(out / "sft_state.json", state, indent=1)


def clicks(trajectory: Trajectory) -> int:
    """The clicks a trajectory's trained replies write (UI-TARS replies, as the pointing loss reads them; a
    recovery demo's deliberate miss is not trained, a reply that does not parse has none).

    >>> from arpo_core.trajectory import Step
    >>> click = "Action: click(start_box='(3,4)')"
    >>> steps = [Step(0, b"", 1, 1, click), Step(1, b"", 1, 1, click, train_reply=False)]
    >>> clicks(Trajectory("r", "demos", 0, "d", "t", "i", steps + [Step(2, b"", 1, 1, "Action: ?")]))
    1
    """
    n = 0
    for s in trajectory.steps:
        if s.train_reply:
            with suppress(ActionParseError):
                n += sum(a.kind == "click" for a in parse_response(s.response_text).actions)
    return n


def sft(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    config: SFTConfig,
    *,
    spec: PromptSpec,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    point_history: list[float] | None = None,
) -> list[float]:
    """Behaviour cloning of `policy` (in place) on the trained replies of `trajectories`
    (decision "Cloned replies"), with params' `sft` section `config` and the prompt of params' `policy`
    section (`spec`: the system prompt and the history window).

    Returns the loss of every optimizer step (mean NLL per assistant token over its accumulated batch);
    with `config.point_weight` > 0, each step's pointing loss is appended to `point_history` where given
    (decision "Pointing loss"). Checkpoints go to `checkpoint_dir/step-N/` and `checkpoint_dir/final/`.
    """
    if not trajectories:
        raise ValueError("sft needs at least one trajectory")
    if not any(s.train_reply for t in trajectories for s in t.steps):
        raise ValueError("sft needs at least one reply to train on (every step has train_reply False)")
    model = policy.model
    device = policy.device
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.warmup_steps, config.steps, config.min_lr_frac)
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if config.optimizer.bf16 else nullcontext()
    order: list[int] = []
    history: list[float] = []
    # Decision "Pointing loss": the demos whose clicks it teaches.
    pointed = [not config.point_one_click or clicks(t) == 1 for t in trajectories]
    model.train()
    bar = tqdm(range(1, config.steps + 1), desc="sft", disable=not progress)
    for step in bar:
        micro = []
        for _ in range(config.grad_accum):
            idx = []
            while len(idx) < config.batch_size:
                if not order:
                    order = list(range(len(trajectories)))
                    rng.shuffle(order)
                idx.append(order.pop())
            # Encoded per batch, not up front: pixel tensors of a few thousand demos would take GBs.
            seqs = [
                (seq, pointed[i])
                for i in idx
                for seq in encode_trajectory_windows(policy, trajectories[i], spec=spec)
            ]
            # Decision "Length-sorted forwards": at most batch_size rows per forward, rows of similar length
            # together.
            seqs.sort(key=lambda q: len(q[0].input_ids))
            parts = math.ceil(len(seqs) / config.batch_size)
            cuts = [k * len(seqs) // parts for k in range(parts + 1)]
            micro += [
                (
                    collate([q for q, _ in seqs[a:b]], policy.pad_id, policy.image_token_id).to(device),
                    [click_targets(policy, q) if p else [] for q, p in seqs[a:b]]
                    if config.point_weight
                    else [],
                )
                for a, b in itertools.pairwise(cuts)
            ]
        n_total = sum(int((b.assistant_mask & b.attention_mask.bool())[:, 1:].sum()) for b, _ in micro)
        n_points = sum(len(q) for _, rows in micro for spans in rows for q, _ in spans)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = point_sum = 0.0
        for batch, rows in micro:
            capture = HeadWeights(policy, config.point_heads) if n_points else nullcontext()
            with autocast, capture:
                logps, mask = sequence_logprobs(model, batch)  # (B, T) each
            # Weight each micro-batch by its share of tokens so the step is a token-mean
            # (decision "Token-mean NLL").
            loss = masked_mean_nll(logps, mask) * (mask.sum() / max(n_total, 1))
            loss_sum += float(loss.detach())
            if n_points:  # decision "Pointing loss": a mean over the accumulated batch's positions and heads
                terms = capture.point_terms(rows)
                point = terms.sum() / (n_points * config.point_heads)
                loss = loss + config.point_weight * point
                point_sum += float(point.detach())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.max_grad_norm)
        optimizer.step()
        sched.step()
        history.append(loss_sum)
        if config.point_weight and point_history is not None:
            point_history.append(point_sum)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        if checkpoint_dir is not None and config.checkpoint_every and step % config.checkpoint_every == 0:
            _save(
                policy,
                optimizer,
                Path(checkpoint_dir) / f"step-{step}",
                {"step": step, "losses": history, "config": asdict(config)},
            )
    model.eval()
    if checkpoint_dir is not None:
        _save(
            policy,
            optimizer,
            Path(checkpoint_dir) / "final",
            {"step": config.steps, "losses": history, "config": asdict(config)},
        )
    return history
