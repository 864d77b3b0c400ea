"""The ARPO/GRPO epoch loop: rollout groups -> replay fill -> advantages -> update -> buffer -> checkpoint.

Decisions:
1. One iteration = `tasks_per_iteration` tasks x `group_size` rollouts (docs/method.md §1-2). Tasks are
   visited in a seeded order per epoch; an epoch is one pass over the task set.
2. ARPO order of operations as the reference: fresh groups are filled from the buffer (all-failed group
   + stored success -> one slot replaced), advantages are computed on the filled groups, the update runs,
   and only then the buffer is updated with the FRESH rollouts (replay.py decision 7).
3. A group with an env-failed job (rollout.py decision 3) is dropped from the update: GRPO statistics
   need the group's G samples, and an env fault says nothing about the policy.
4. Every ablation switch of the paper is a parameter (train.replay.enabled, train.use_selection, loss
   clip/KL/aggregation, format penalty, group size, lr); nothing is hard-wired.
5. Checkpoint at the end of every epoch, atomically: the whole directory is written under a temp name
   and renamed, then the `latest` pointer file is replaced. It holds the policy (save_pretrained), the
   engine/optimizer state, the replay buffer, the RNG states, the epoch counter, the policy version and
   the metric history. A run killed at any point resumes from the last complete epoch; the partial
   epoch is re-run from its start with the same seeds, so the replay buffer and epoch count equal an
   uninterrupted run's.
6. `policy_version` counts optimizer updates (iterations); stored on each trajectory so replay
   staleness can be measured.
7. Evaluation and metric logging are callbacks (`on_iteration`, `on_epoch`): the library does not know
   MLflow (docs/design.md), and the per-epoch evaluation's results go into the checkpointed history.
8. `train.loss.kl_coef > 0` keeps a frozen reference policy: the run's starting policy (`policy_dir`,
   also on resume - the reference never moves), loaded once, in eval mode, without gradients. Its
   per-token log-probs of every update batch enter the loss as the KL penalty (losses.py decision 3).
   ARPO's default is 0: no reference is loaded and no extra forward runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arpo_core.advantages import group_advantages
from arpo_core.engines import make_engine
from arpo_core.envs.base import TaskSpec
from arpo_core.fileio import atomic_write_text
from arpo_core.policy.generate import HFGenerator
from arpo_core.policy.model import Policy, load_policy
from arpo_core.replay import ReplayBuffer, ReplayConfig
from arpo_core.rollout import RolloutConfig, make_group_jobs, run_episodes
from arpo_core.trajectory import Trajectory, write_trajectories
from arpo_core.update import UpdateConfig, compute_logps, encode_trajectories, ppo_update

__all__ = ["PreparedBatch", "TrainState", "TrainerSettings", "latest_checkpoint", "prepare_batch", "train"]


@dataclass(frozen=True)
class TrainerSettings:
    """Everything the loop needs, flattened from params.yaml sections by the caller."""

    epochs: int = 3
    tasks_per_iteration: int = 4
    group_size: int = 8
    lr: float = 1e-5
    weight_decay: float = 1e-2
    max_grad_norm: float = 1.0
    engine: str = "torch"
    zero_stage: int = 2
    advantage_scale: str = "group"
    advantage_eps: float = 1e-6
    skip_zero_advantage: bool = False
    """Drop sequences whose advantage is exactly 0 from the update (saves compute; changes token-mean
    normalisation like DAPO's filter). The reference keeps them (false)."""
    system: str = "compact"
    history_images: int | None = None
    seed: int = 0
    update: UpdateConfig = field(default_factory=UpdateConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)


@dataclass
class TrainState:
    epoch: int = 0
    """Completed epochs."""
    policy_version: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per completed epoch (training metrics + whatever on_epoch returned)."""


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The directory of the last complete epoch checkpoint, or None."""
    pointer = Path(out_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _save_checkpoint(out_dir: Path, policy: Policy, engine, replay: ReplayBuffer, state: TrainState) -> Path:
    ckpts = out_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    name = f"epoch-{state.epoch:04d}"
    tmp = ckpts / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    policy.save(tmp / "policy")
    engine.save(tmp)
    replay.save(tmp / "replay")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(
        json.dumps(
            {"epoch": state.epoch, "policy_version": state.policy_version, "history": state.history}, indent=1
        )
    )
    final = ckpts / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write_text(ckpts / "latest", name)
    # Keep the last two epochs: the newest, and one more in case the newest is damaged on disk.
    for old in sorted(p for p in ckpts.glob("epoch-*") if p.is_dir())[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _load_reference(policy_dir: str | os.PathLike, policy: Policy) -> Policy:
    """Decision 8: the frozen starting policy, on the trained policy's device and in its dtype."""
    dtype = next(policy.model.parameters()).dtype
    ref = load_policy(policy_dir, dtype=dtype, device=str(policy.device))
    ref.model.eval()
    ref.model.requires_grad_(False)
    return ref


def _iteration_chunks(tasks: Sequence[TaskSpec], k: int, seed: int, epoch: int) -> list[list[TaskSpec]]:
    order = list(tasks)
    random.Random(seed * 7919 + epoch).shuffle(order)
    return [order[i : i + k] for i in range(0, len(order), k)]


def _groups(trajs: Sequence[Trajectory]) -> dict[int, list[Trajectory]]:
    out: dict[int, list[Trajectory]] = {}
    for t in trajs:
        out.setdefault(t.group_id, []).append(t)
    return out


@dataclass
class PreparedBatch:
    trajectories: list[Trajectory]
    """The filled groups, group-contiguous (replayed items marked)."""
    advantages: torch.Tensor
    """(N,) group-relative advantages of `trajectories`."""
    n_groups: int
    n_replayed: int


def prepare_batch(
    fresh: Sequence[Trajectory],
    replay: ReplayBuffer,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
) -> PreparedBatch:
    """Decisions 2-3: complete groups only, replay fill, then group advantages. Does NOT add `fresh` to
    the buffer (the caller does that after the update)."""
    groups = [g for g in _groups(fresh).values() if len(g) == group_size]
    filled = [t for f in replay.apply(groups) for t in f.group]
    if not filled:
        return PreparedBatch([], torch.zeros(0), 0, 0)
    rewards = torch.tensor([t.reward for t in filled], dtype=torch.float32)  # (N,)
    adv = group_advantages(rewards, group_size, scale=scale, eps=eps)  # (N,)
    return PreparedBatch(filled, adv, len(groups), sum(t.replayed for t in filled))


def train(
    policy_dir: str | os.PathLike,
    tasks: Sequence[TaskSpec],
    out_dir: str | os.PathLike,
    settings: TrainerSettings,
    pool,
    *,
    resume: bool = True,
    run_id: str = "train",
    on_iteration: Callable[[int, int, dict[str, float]], None] | None = None,
    on_epoch: Callable[[int, Policy], dict[str, Any] | None] | None = None,
    progress_factory: Callable[..., Any] | None = None,
    generator_factory: Callable[[Policy], Any] | None = None,
) -> TrainState:
    """Train from `policy_dir` (or resume from `out_dir`'s last checkpoint) for `settings.epochs` epochs.

    Trajectories go to `out_dir/trajectories/epoch-EEEE-iter-III.parquet` (filled groups, replayed flag
    set), checkpoints to `out_dir/checkpoints/`. Returns the final state (its history has one entry per
    epoch).
    """
    out_dir = Path(out_dir)
    s = settings
    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        policy = load_policy(ckpt / "policy")
        meta = json.loads((ckpt / "state.json").read_text())
        state = TrainState(meta["epoch"], meta["policy_version"], meta["history"])
        replay = ReplayBuffer.load(ckpt / "replay", config=s.replay)
    else:
        policy = load_policy(policy_dir)
        state = TrainState()
        replay = ReplayBuffer(s.replay)
    reference = _load_reference(policy_dir, policy) if s.update.kl_coef > 0 else None
    engine = make_engine(
        s.engine,
        policy.model,
        lr=s.lr,
        weight_decay=s.weight_decay,
        max_grad_norm=s.max_grad_norm,
        zero_stage=s.zero_stage,
        bf16=s.update.bf16,
    )
    if ckpt is not None:
        engine.load(ckpt)
        _set_rng_state(torch.load(ckpt / "rng.pt", weights_only=False))
    else:
        random.seed(s.seed)
        np.random.seed(s.seed)
        torch.manual_seed(s.seed)
    generator = (
        generator_factory(policy)
        if generator_factory is not None
        else HFGenerator(policy, system=s.system, history_images=s.history_images)
    )

    for epoch in range(state.epoch + 1, s.epochs + 1):
        chunks = _iteration_chunks(tasks, s.tasks_per_iteration, s.seed, epoch)
        epoch_metrics: list[dict[str, float]] = []
        for it, chunk in enumerate(chunks):
            t0 = time.monotonic()
            jobs = make_group_jobs(chunk, s.group_size, seed=s.seed * 1_000_003 + epoch * 1009 + it * 37)
            bar = (
                progress_factory(total=len(jobs), desc=f"epoch {epoch} iter {it} rollout")
                if progress_factory
                else None
            )
            res = run_episodes(
                pool,
                generator,
                jobs,
                replace(s.rollout, seed=s.seed + epoch * 100 + it),
                run_id=run_id,
                stage="train",
                epoch=epoch,
                policy_version=state.policy_version,
                progress=bar,
            )
            if bar is not None:
                bar.close()
            batch = prepare_batch(res.trajectories, replay, s.group_size, s.advantage_scale, s.advantage_eps)
            filled, adv = batch.trajectories, batch.advantages
            metrics = dict(res.metrics)
            if filled:
                keep = [i for i in range(len(filled)) if not (s.skip_zero_advantage and adv[i] == 0)]
                seqs = encode_trajectories(policy, [filled[i] for i in keep], s.system, s.history_images)
                t_up = time.monotonic()
                ref_logps = (
                    compute_logps(reference, seqs, s.update.micro_batch_size, s.update.bf16)
                    if reference is not None
                    else None
                )
                ustats = ppo_update(
                    policy,
                    engine,
                    seqs,
                    adv[keep],
                    replace(s.update, seed=s.seed + epoch * 1000 + it),
                    ref_logps=ref_logps,
                )
                metrics.update(ustats.as_metrics())
                metrics["time/update_s"] = time.monotonic() - t_up
                metrics["train/nonzero_adv_frac"] = float((adv != 0).float().mean())
                state.policy_version += 1
            replay.add(res.trajectories)
            metrics.update(replay.stats().as_metrics())
            metrics["train/groups"] = float(batch.n_groups)
            metrics["train/replayed"] = float(batch.n_replayed)
            metrics["time/iteration_s"] = time.monotonic() - t0
            if filled:
                write_trajectories(
                    out_dir / "trajectories" / f"epoch-{epoch:04d}-iter-{it:03d}.parquet", filled
                )
            epoch_metrics.append(metrics)
            if on_iteration is not None:
                on_iteration(epoch, it, metrics)
        summary = _mean_metrics(epoch_metrics)
        summary["epoch"] = epoch
        summary["policy_version"] = state.policy_version
        if on_epoch is not None:
            summary.update(on_epoch(epoch, policy) or {})
        state.history.append(summary)
        state.epoch = epoch
        _save_checkpoint(out_dir, policy, engine, replay, state)
    return state


def _mean_metrics(rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    keys = sorted({k for r in rows for k in r})
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}
