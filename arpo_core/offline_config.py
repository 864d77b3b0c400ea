"""Configs of the offline training methods (grounding, behaviour cloning, RFT, DPO, KTO), kept free of torch so
that params.yaml can be parsed and validated without importing the training stack (`arpo params` stays
fast). The training code lives in grounding.py, offline.py and preference.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DPOConfig", "GroundTrainConfig", "KTOConfig", "RFTConfig", "SFTConfig"]


@dataclass(frozen=True)
class GroundTrainConfig:
    """Grounding-pretraining hyperparameters shared by a params phase (`config.GroundPhase`) and the
    training loop's config (`grounding.GroundConfig`), which each add their own fields."""

    steps: int = 2000
    """Optimizer steps."""
    batch_size: int = 16
    """Examples per optimizer step (half from a fixed example list when one is given, e.g. real MiniWoB
    screens; the rest fresh synthetic screens)."""
    lr: float = 3e-3
    """AdamW peak learning rate."""
    warmup_steps: int = 50
    """Linear warm-up from 0 to `lr` over this many steps."""
    min_lr_frac: float = 0.1
    """Cosine decay from `lr` to `min_lr_frac * lr` at the last step."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    bf16: bool = True
    """bf16 autocast; parameters and optimizer state stay fp32."""
    mix: dict[str, float] = field(default_factory=lambda: {"box1": 1.0})
    """Synthetic level -> sampling weight (levels of `arpo_core.grounding.LEVELS`)."""
    seed: int = 0
    """Seed of the stream of synthetic screens and of the fixed list's order (held-out sets use other
    seeds)."""


@dataclass(frozen=True)
class SFTConfig:
    """Behaviour-cloning hyperparameters."""

    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 8
    """Trajectories per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 1e-3
    """AdamW learning rate (constant after warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    bf16: bool = False
    """bf16 autocast (CPU or GPU); parameters and optimizer stay fp32."""
    checkpoint_every: int = 0
    """Save every N optimizer steps (0 = only at the end, and only with a checkpoint_dir)."""
    seed: int = 0
    """Shuffling seed."""


@dataclass(frozen=True)
class DPOConfig:
    """DPO on success-vs-failure pairs of the same task (decisions 3-4)."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * (log pi - log ref) (TRL default 0.1)."""
    label_smoothing: float = 0.0
    """cDPO: assumed probability that a preference label is flipped (0 = plain DPO)."""
    success_threshold: float = 0.1
    """A trajectory with success > this is 'chosen', the others 'rejected' (strict, as selection.py
    and replay.py count a success)."""
    max_pairs_per_task: int | None = 16
    """Cap on pairs per task (None: max(successes, failures) of the task)."""
    steps: int = 50
    """Optimizer steps."""
    batch_size: int = 8
    """Pairs per optimizer step."""
    micro_batch_size: int = 2
    """Pairs per forward/backward (2x as many sequences)."""
    lr: float = 1e-5
    """AdamW learning rate (TRL's DPO default 1e-6 is for 7B models; the tiny policy needs more)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    bf16: bool = False
    """bf16 autocast for the forward passes."""
    seed: int = 0
    """Seed of pairing and batch order."""


@dataclass(frozen=True)
class KTOConfig:
    """KTO on desirable (successful) and undesirable (failed) trajectories, unpaired (decisions 5-6)."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (TRL default 0.1)."""
    desirable_weight: float = 1.0
    """lambda_D: weight of the desirable losses."""
    undesirable_weight: float = 1.0
    """lambda_U: weight of the undesirable losses."""
    balance: bool = True
    """Scale the two weights so lambda_D n_D / (lambda_U n_U) is in [1, 4/3] (TRL's advice)."""
    success_threshold: float = 0.1
    """A trajectory with success > this is desirable, the others undesirable (strict, as elsewhere)."""
    steps: int = 50
    """Optimizer steps."""
    batch_size: int = 8
    """Trajectories per optimizer step (the KL reference point is estimated on this batch; >= 2)."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    bf16: bool = False
    """bf16 autocast for the forward passes."""
    seed: int = 0
    """Seed of KL partners and batch order."""


@dataclass(frozen=True)
class RFTConfig:
    """Rejection-sampling fine-tuning: SFT on the successful trajectories (decision 7)."""

    success_threshold: float = 0.1
    """Trajectories with success > this are kept (strict, as elsewhere)."""
    max_per_task: int | None = 16
    """Keep at most this many successes per task (None: all)."""
    seed: int = 0
    """Seed of which successes are kept when a task has more than max_per_task."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The behaviour-cloning run on the kept trajectories."""
