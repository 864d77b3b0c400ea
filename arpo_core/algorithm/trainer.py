"""The ARPO/GRPO epoch loop: rollout groups -> replay fill -> advantages -> update -> buffer -> checkpoint.

Decisions:
- **Iteration shape.** One iteration = `tasks_per_iteration` tasks x `groups_per_task` groups x `group_size`
  rollouts (docs/method.md §1-2; the reference has one group per task). Each group of a task plays its own
  task instance (env seed) under its own group id, unique within the iteration (rollout.py
  `make_group_jobs`), so G=4 x 4 groups gives an update the 16 rollouts per task of G=16 x 1 while the
  group baseline stays per instance. Tasks are visited in a seeded order per epoch; an epoch is one
  pass over the task set. `train` only composes three phases: `_restore_or_start`, `_run_iteration`
  (rollout -> `prepare_batch` (replay fill + advantages) -> update -> buffer add -> trajectories
  written) and `_end_epoch` (summary, `on_epoch`, checkpoint).
- **ARPO order of operations.** ARPO order of operations as the reference: fresh groups are filled from the
  buffer (all-failed group + stored success -> one slot replaced), advantages are computed on the filled
  groups, the update runs, and only then the buffer is updated with the FRESH rollouts (replay.py,
  decision "No re-storing"). With
  groups_per_task > 1 every all-failed group of a task is filled on its own: each draws uniformly from
  the task's stored successes with the buffer's RNG, independently (with replacement, as the
  reference's one `get_pos` call per group), so two groups may get the same stored success or two
  different ones. A sibling group's success of the same iteration is not in the buffer yet and is never
  drawn: it is already in the batch, fresh.
- **Env-failed groups dropped.** A group with an env-failed job (rollout.py, decision "Env fault retries") is
  dropped from the update: GRPO statistics need the group's G samples, and an env fault says nothing about the
  policy.
- **Ablations are parameters.** Every ablation switch of the paper is a parameter (train.replay.enabled,
  train.use_selection, loss clip/KL/aggregation, format penalty, group size, groups per task, lr); nothing is
  hard-wired. The params sections arrive as they are (`TrainConfig`, `PolicyConfig`), never copied into a
  settings class of our own.
- **Atomic epoch checkpoints.** Checkpoint at the end of every epoch, atomically: the whole directory is
  written under a temp name and renamed, then the `latest` pointer file is replaced. It holds the policy
  (save_pretrained), the engine/optimizer state, the replay buffer, the RNG states, the epoch counter, the
  policy version and the metric history. A run killed at any point resumes from the last complete epoch; the
  partial epoch is re-run from its start with the same seeds, so the replay buffer and epoch count equal an
  uninterrupted run's.
  Every checkpoint is verified when written and when loaded (decision "Checkpoint integrity").
- **Policy version.** `policy_version` counts optimizer updates (iterations); stored on each trajectory so
  replay staleness can be measured.
- **Logging by callbacks.** Evaluation and metric logging are callbacks (`on_iteration`, `on_epoch`): the
  library does not know MLflow (docs/design.md), and the per-epoch evaluation's results go into the
  checkpointed history.
- **Frozen reference policy.** `train.loss.kl_coef > 0` keeps a frozen reference policy: the run's starting
  policy (`policy_dir`, also on resume - the reference never moves), loaded once, in eval mode, without
  gradients. Its per-token log-probs of every update batch enter the loss as the KL penalty (losses.py,
  decision "KL before aggregation"). ARPO's default is 0: no reference is loaded and no extra forward runs.
- **Derived randomness.** Every random choice derives from the run seed and its place in the run (seeds.py):
  the epoch's task order from ("task_order", seed, epoch), an iteration's env instances from ("env", seed,
  epoch, it) (group g of the job list plays instance base + g; with groups_per_task=1 group g is task g), its
  samples from ("sample", seed, epoch, it, job, step) inside the rollout, its mini-batch order from
  ("minibatch", seed, epoch, it). Nothing depends on the replay buffer or on timing, so ARPO and GRPO
  (train.replay.enabled true / false) play the same first iteration, episode for episode.
- **Per-task metrics.** Per-task metrics (`task_metrics`) in every iteration's row, so a run shows which tasks
  triggered replay: `task/<domain>/<task_id>/{episodes, success_rate, all_fail_groups, replay_fills,
  buffer_size}`, names cleaned as evaluation.py's per-task keys are (MLflow's key alphabet).
  `all_fail_groups` counts the complete groups that met the replay trigger (replay.py,
  decision "Trigger rule"; also with replay disabled), `replay_fills` those filled from the buffer,
  `buffer_size` the task's stored successes after the iteration's buffer add; `success_rate` is over the
  task's finished fresh episodes (absent when none finished), so the episode-weighted mean of the tasks' rates
  is `rollout/success_rate`.
- **Epoch summary reduction.** The epoch summary (`epoch_summary`, a history row) reduces the iteration rows
  by what a key means, not by one blanket mean: counts are SUMMED over the epoch (`task/.../{episodes,
  all_fail_groups, replay_fills}`, `train/groups`, `train/replayed` (= groups filled), `rollout/{episodes,
  env_faults, failed_jobs}`); per-episode rates (`task/.../success_rate`, `rollout/{success_rate,
  format_error_rate, mean_steps, mean_reward}`) are averaged over the episodes, each row weighted by
  its episode count, not over iterations; the buffer's state (`task/.../buffer_size`, and `replay/*`:
  counters and rates since the buffer was created) is its value at the epoch's end (the last row
  holding the key; a task's size changes only in its own iteration); everything else (losses, clip
  fractions, times, `train/nonzero_adv_frac`) is the mean over iterations. Until issue 15 every key was
  the mean over iterations: the history's counts were per-iteration means and `replay/*` the mean of
  running totals. `logprob/*max*` keys are the maximum over the epoch's iterations.
- **Weight sync.** A generator that holds its own copy of the weights (the vLLM backend, generate.py,
  decision "Generator backends") gets the policy's new weights after every update (`sync_weights`, after the
  update's last optimizer step, before the next rollout; `before_update` first lets it free GPU memory), and
  once when it is built. Its log-probs are only a diagnostic: the update's old log-probs are the trainer's
  recomputation (`compute_logps` under the behaviour weights, passed to `ppo_update`), and the fresh replies'
  summed log-probs are compared with the generator's (`logprob/gen_vs_train_max_abs`: the largest |difference|
  of one reply's sum; `..._per_token`: that difference over the reply's tokens, max and mean). With
  the HF backend the generator is the trained model itself: nothing to sync or compare.
- **Checkpoint integrity.** Checkpoint integrity (issue 34). A checkpoint's last file is its manifest
  (`checkpoint.json`: size and sha256 of every other file, computed from the bytes on disk after each is
  fsynced); before the directory is renamed into place it is checked (`checkpoint_problem` without hashes: the
  manifest reads back and matches the tree, and every file passes its format check, fileio.py,
  decision "Cheap integrity checks", which is what catches a writer that stopped short without an error).
  Loading checks sizes and hashes against the manifest. `latest_checkpoint` returns the newest checkpoint that
  passes: the one the `latest` pointer names, else (pointer empty, garbage, naming a missing or damaged
  directory) the newest `epoch-NNNN` that passes, with one warning line per problem naming the file and what
  is wrong. A run whose checkpoints directory holds something but no usable checkpoint says so before
  it starts from epoch 1. Checkpoints written before manifests existed still load: without a manifest
  only the format checks apply (state.json and rng.pt, the policy's config.json and the replay
  manifest present, every safetensors/torch/JSON/Parquet file whole), which catch truncation without
  hashing. Rotation keeps the new checkpoint and the newest older one that passes, whatever their
  names sort to; anything else goes (damaged ones, and newer ones left by an earlier run, which would
  otherwise shadow this run's in a fallback). Hashing costs one read of the checkpoint per write and
  per load (about 1 s per GB); results are cached per process by the manifest's identity, so the
  stage's later calls do not hash again.
- **Buffer preload.** Buffer preload (`train.replay.preload`, off by default as in the reference): the caller
  passes the baseline's rollouts; their successes of the trained tasks enter the buffer before epoch 1 by the
  buffer's own rules, so an all-failed group can be filled from the first iteration on. A resumed run
  takes the buffer from its checkpoint, which already holds them (or their successors).
- **Image-blind arm.** The image-blind control arm (`train.image_blind`): the policy (and the frozen
  reference) is marked `image_blind`, so every forward of it - generation, old log-probs, the update - sees
  blank screenshots of the same size; the stored trajectories keep the real ones.
- **Data-parallel ranks.** (`ranks`, distributed.py): each rank plays its share of the iteration's groups with
  its own env pool and generator; rank 0 merges the episodes, fills and computes advantages with the one
  buffer it owns, adds to it, writes the trajectories and the metrics, and sends each rank its trajectories of
  the update, which normalises over all ranks (update.py, decision "Global normalisation"). Checkpoints: rank
  0 writes the policy, buffer, RNG and state; every rank joins what is collective (DeepSpeed's sharded engine
  state; a ZeRO-3 policy's gathered weights). On resume rank 0 picks the checkpoint and every rank loads it,
  so a run resumes with any number of ranks (engines.py, decision "Data-parallel ranks", for what a DeepSpeed
  optimizer state needs). Under ZeRO-3 over several ranks the generator and the evaluations run on an
  unpartitioned copy of the policy synced after every update (distributed.py, decision "ZeRO-3 lockstep").
  Each rank reports its phase to a heartbeat file (distributed.py, decision "Rank heartbeats").
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from arpo_core.algorithm.advantages import group_advantages
from arpo_core.algorithm.distributed import SINGLE, Heartbeat, Ranks, assign_units, split_jobs
from arpo_core.algorithm.engines import make_engine
from arpo_core.algorithm.replay import FILLED, NOT_FAILED, FillResult, ReplayBuffer
from arpo_core.algorithm.rollout import RolloutConfig, make_group_jobs, merge_results, run_episodes
from arpo_core.algorithm.update import (
    Shard,
    compute_logps,
    encode_trajectories,
    ppo_update,
    trajectory_units,
)
from arpo_core.config import PolicyConfig, TrainConfig
from arpo_core.envs.base import TaskSpec
from arpo_core.infra.fileio import (
    atomic_write_json,
    atomic_write_text,
    check_space,
    file_problem,
    sha256_file,
    tree_size,
    write_error,
)
from arpo_core.infra.seeds import derive_seed
from arpo_core.policy.generate import Generator, HFGenerator
from arpo_core.policy.model import Policy, load_policy
from arpo_core.policy.prompt import PromptSpec
from arpo_core.policy.sequences import reply_logprob_sums
from arpo_core.trajectory import Trajectory, write_trajectories

__all__ = [
    "PreparedBatch",
    "TrainState",
    "checkpoint_problem",
    "epoch_summary",
    "latest_checkpoint",
    "logprob_gap",
    "prepare_batch",
    "task_metrics",
    "train",
]

ENV_SEED_BITS = 40
"""Env instance seeds of training groups stay below 2^40: MiniWoB hands them to JavaScript, whose
numbers are exact only below 2^53 (seeds.py, decision "Seed width"), and group g adds g."""


@dataclass
class TrainState:
    epoch: int = 0
    """Completed epochs."""
    policy_version: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per completed epoch (training metrics + whatever on_epoch returned)."""


CHECKPOINT_MANIFEST = "checkpoint.json"
"""Decision "Checkpoint integrity": the last file of every checkpoint, sizes and sha256 of the others."""
_EPOCH_DIR = re.compile(r"epoch-(\d{4,})")
_LEGACY_REQUIRED = ("state.json", "rng.pt", "policy/config.json", "replay/manifest.json")
"""What every checkpoint this project has written holds (decision "Atomic epoch checkpoints"), checked where
no manifest is."""
_log = logging.getLogger("arpo.train")
_verified: dict[str, tuple[int, int, int]] = {}
"""Checkpoint dir -> identity (inode, size, mtime) of the manifest it passed with
(decision "Checkpoint integrity" cache)."""
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    """One warning line per problem and process: the stage asks for the latest checkpoint several times."""
    if msg not in _warned:
        _warned.add(msg)
        _log.warning(msg)


def _epoch_dirs(ckpts: Path) -> list[Path]:
    """The `epoch-NNNN` checkpoint directories under `ckpts`, newest epoch first."""
    if not ckpts.is_dir():
        return []
    dirs = [p for p in ckpts.iterdir() if _EPOCH_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(dirs, key=lambda p: int(p.name[6:]), reverse=True)


def _write_manifest(ckpt: Path) -> None:
    """Decision "Checkpoint integrity": sizes and hashes of every file under `ckpt` (each fsynced first),
    written last."""
    files = {}
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != CHECKPOINT_MANIFEST):
        files[f.relative_to(ckpt).as_posix()] = {
            "size": f.stat().st_size,
            "sha256": sha256_file(f, fsync=True),
        }
    atomic_write_json(ckpt / CHECKPOINT_MANIFEST, {"format": 1, "files": files}, indent=1, sort_keys=True)


def _manifest_id(manifest: Path) -> tuple[int, int, int]:
    st = manifest.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def checkpoint_problem(ckpt: str | os.PathLike, hashes: bool = True) -> str | None:
    """Decision "Checkpoint integrity": what is wrong with the checkpoint directory `ckpt` (naming the file),
    or None when it is complete. With a manifest: every listed file present with its size (and, with `hashes`,
    its sha256); without one (an older checkpoint) or without `hashes`: the format checks."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return f"{ckpt} is missing"
    manifest = ckpt / CHECKPOINT_MANIFEST
    key = str(ckpt.resolve())
    if manifest.exists():
        if hashes and key in _verified and _verified[key] == _manifest_id(manifest):
            return None
        try:
            files = json.loads(manifest.read_text())["files"]
            entries = [(rel, int(v["size"]), str(v["sha256"])) for rel, v in files.items()]
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            return f"{manifest} is unreadable ({type(e).__name__}: {e})"
        for rel, size, digest in sorted(entries):
            f = ckpt / rel
            if not f.is_file():
                return f"{f} is missing (listed in {manifest.name})"
            if f.stat().st_size != size:
                return f"{f} has {f.stat().st_size} bytes, {manifest.name} says {size} (truncated or overwritten)"
            if hashes and sha256_file(f) != digest:
                return f"{f} does not match its sha256 in {manifest.name} (its content changed)"
        required = ("state.json", "rng.pt")
    else:
        required = _LEGACY_REQUIRED
    if hashes and manifest.exists():  # the bytes are those that passed the format checks when written
        _verified[key] = _manifest_id(manifest)
        return None
    for rel in required:
        if not (ckpt / rel).is_file():
            return f"{ckpt / rel} is missing"
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        problem = file_problem(f)
        if problem is not None:
            return problem
    try:
        meta = json.loads((ckpt / "state.json").read_text())
        int(meta["epoch"]), int(meta["policy_version"]), list(meta["history"])
    except (KeyError, TypeError, ValueError) as e:
        return f"{ckpt / 'state.json'} lacks the epoch, policy_version or history ({type(e).__name__}: {e})"
    return None


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete, verified epoch checkpoint, or None (decision "Checkpoint integrity"): the one
    `latest` names, else the newest `epoch-NNNN` that passes `checkpoint_problem`; one warning line per
    problem found, naming the file, what is wrong and which checkpoint is used instead."""
    ckpts = Path(out_dir) / "checkpoints"
    pointer = ckpts / "latest"
    dirs = _epoch_dirs(ckpts)
    problems: list[str] = []
    named: Path | None = None
    if pointer.is_file():
        try:
            text = pointer.read_text(errors="replace").strip()
        except OSError as e:
            text = f"<unreadable: {e}>"
        if _EPOCH_DIR.fullmatch(text):
            named = ckpts / text
        else:
            what = "is empty" if not text else f"does not name a checkpoint ({text[:40]!r})"
            problems.append(f"checkpoint pointer {pointer} {what}")
    elif dirs:
        problems.append(f"checkpoint pointer {pointer} is missing")
    found: Path | None = None
    if named is not None:
        problem = checkpoint_problem(named)
        if problem is None:
            found = named
        else:
            problems.append(f"checkpoint {named.name} (named by {pointer}) is unusable: {problem}")
    for d in dirs if found is None else ():
        if d == named:
            continue
        problem = checkpoint_problem(d)
        if problem is None:
            found = d
            break
        problems.append(f"checkpoint {d.name} is unusable: {problem}")
    outcome = f"using {found} instead" if found is not None else "no usable checkpoint is left"
    for problem in problems:
        _warn_once(f"{problem}; {outcome}")
    return found


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _save_checkpoint(
    out_dir: Path, policy: Policy, engine, replay: ReplayBuffer, state: TrainState, ranks: Ranks = SINGLE
) -> Path:
    ckpts = out_dir / "checkpoints"
    name = f"epoch-{state.epoch:04d}"
    tmp = ckpts / f".{name}.tmp"
    final = ckpts / name
    if (
        ranks.distributed
    ):  # decision "Data-parallel ranks": collective parts on every rank, the rest on rank 0
        return _save_checkpoint_ranks(out_dir, policy, engine, replay, state, ranks)
    # Disk full: fail before writing when the last checkpoint's size does not fit, and on any write
    # failure remove the partial temp dir and say what, where and how much (fileio.py,
    # decision "Clear output errors"); the previous checkpoint and `latest` stay as they were.
    needed = _prepare_checkpoint(out_dir, name)
    try:
        tmp.mkdir()
        policy.save(tmp / "policy")
        engine.save(tmp)
        _finish_checkpoint(tmp, name, replay, state)
    except Exception as e:
        written = tree_size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(e, f"checkpoint {name}", ckpts, needed=max(needed, written) or None)
        if err is None:
            raise
        raise err from e
    return _publish_checkpoint(ckpts, tmp, final, state)


def _prepare_checkpoint(out_dir: Path, name: str) -> int:
    """Remove the partial checkpoints of a killed run and check there is room for one more the size of the
    last; returns that size."""
    ckpts = out_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    for stale in ckpts.glob(".epoch-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    previous = latest_checkpoint(out_dir)
    needed = tree_size(previous) if previous is not None else 0
    check_space(ckpts, needed, f"checkpoint {name}")
    return needed


def _finish_checkpoint(tmp: Path, name: str, replay: ReplayBuffer, state: TrainState) -> None:
    """Write what rank 0 alone owns (buffer, RNG, epoch state) beside the policy and engine files already
    in `tmp`, then the manifest (decision "Checkpoint integrity": last, once every other file is on disk),
    and check the whole."""
    replay.save(tmp / "replay")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(
        json.dumps(
            {"epoch": state.epoch, "policy_version": state.policy_version, "history": state.history},
            indent=1,
        )
    )
    _write_manifest(tmp)
    problem = checkpoint_problem(tmp, hashes=False)
    if problem is not None:
        raise RuntimeError(f"checkpoint {name} failed its check after writing: {problem}")


def _publish_checkpoint(ckpts: Path, tmp: Path, final: Path, state: TrainState) -> Path:
    """Rename the checked temp dir into place, point `latest` at it, rotate
    (decisions "Atomic epoch checkpoints" and "Checkpoint integrity")."""
    name = final.name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(ckpts)  # the rename is durable before the pointer names it
    _verified[str(final.resolve())] = _manifest_id(final / CHECKPOINT_MANIFEST)
    atomic_write_text(ckpts / "latest", name)
    # Keep the new checkpoint and the newest older one that passes its checks, the fallback in case the
    # new one is damaged on disk later (decision "Checkpoint integrity"); not simply the two last names.
    fallback = next(
        (d for d in _epoch_dirs(ckpts) if int(d.name[6:]) < state.epoch and checkpoint_problem(d) is None),
        None,
    )
    for old in _epoch_dirs(ckpts):
        if old not in (final, fallback):
            shutil.rmtree(old, ignore_errors=True)
    return final


def _save_checkpoint_ranks(
    out_dir: Path, policy: Policy, engine, replay: ReplayBuffer, state: TrainState, ranks: Ranks
) -> Path:
    """Decision "Data-parallel ranks": rank 0 prepares the temp dir; every rank writes its part of the engine
    state and
    joins the gather of a ZeRO-3 policy; rank 0 writes the rest, checks, renames; every rank returns
    once the checkpoint is in place. A failure on rank 0 reaches the others as its error text."""
    ckpts = out_dir / "checkpoints"
    name = f"epoch-{state.epoch:04d}"
    tmp, final = ckpts / f".{name}.tmp", ckpts / name
    error = None
    if ranks.main:
        try:
            _prepare_checkpoint(out_dir, name)
            tmp.mkdir()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    error = ranks.broadcast(error)
    if error is not None:
        raise RuntimeError(f"checkpoint {name} could not start on rank 0: {error}")
    engine.save(tmp)  # collective for DeepSpeed (every rank its shards); rank 0 only for torch
    if ranks.main:
        policy.save(tmp / "policy")  # under ZeRO-3 its save_pretrained gathers the shards (engines.py)
    elif getattr(engine, "gathers_in_forward", False):
        with engine.full_weights():  # the same gather, joined by the ranks that do not write
            pass
    ranks.barrier()
    if ranks.main:
        try:
            _finish_checkpoint(tmp, name, replay, state)
            _publish_checkpoint(ckpts, tmp, final, state)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{type(e).__name__}: {e}"
    error = ranks.broadcast(error)
    if error is not None:
        raise RuntimeError(f"checkpoint {name} failed on rank 0: {error}")
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_reference(policy_dir: str | os.PathLike, policy: Policy) -> Policy:
    """Decision "Frozen reference policy": the frozen starting policy, on the trained policy's device and in
    its dtype."""
    dtype = next(policy.model.parameters()).dtype
    ref = load_policy(policy_dir, dtype=dtype, device=str(policy.device))
    ref.image_blind = policy.image_blind  # the same (blank) inputs as the trained policy's forwards
    ref.model.eval()
    ref.model.requires_grad_(False)
    return ref


def _iteration_chunks(tasks: Sequence[TaskSpec], k: int, seed: int, epoch: int) -> list[list[TaskSpec]]:
    """The epoch's tasks in a seeded order (decision "Derived randomness"), `k` per iteration."""
    order = list(tasks)
    random.Random(derive_seed("task_order", seed, epoch)).shuffle(order)
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
    fills: list[FillResult] = field(default_factory=list)
    """`ReplayBuffer.apply`'s result for every complete group, in order (what replay did to each)."""


def prepare_batch(
    fresh: Sequence[Trajectory], replay: ReplayBuffer, group_size: int, *, scale: str, eps: float
) -> PreparedBatch:
    """Decisions "ARPO order of operations" and "Env-failed groups dropped": complete groups only, replay
    fill, then group advantages. Does NOT add `fresh` to the buffer (the caller does that after the
    update)."""
    groups = [g for g in _groups(fresh).values() if len(g) == group_size]
    fills = replay.apply(groups)  # each group on its own (decision "ARPO order of operations")
    filled = [t for f in fills for t in f.group]
    if not filled:
        return PreparedBatch([], torch.zeros(0), 0, 0)
    rewards = torch.tensor([t.reward for t in filled], dtype=torch.float32)  # (N,)
    adv = group_advantages(rewards, group_size, scale=scale, eps=eps)  # (N,)
    return PreparedBatch(filled, adv, len(groups), sum(t.replayed for t in filled), fills)


_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")


def _clean(name: str) -> str:
    """The rule of evaluation.py's per-task keys (MLflow's key alphabet): anything else becomes '_'."""
    return _KEY_CHARS.sub("_", name)


def task_metrics(
    tasks: Sequence[TaskSpec],
    fresh: Sequence[Trajectory],
    fills: Sequence[FillResult],
    buffer_sizes: Mapping[tuple[str, str], int],
) -> dict[str, float]:
    """Decision "Per-task metrics": one iteration's `task/<domain>/<task_id>/...` metrics for each task of
    `tasks`.

    Args:
        fresh: the iteration's finished episodes (before replay).
        fills: `ReplayBuffer.apply`'s results for the complete groups (`PreparedBatch.fills`).
        buffer_sizes: `ReplayBuffer.sizes()` after the iteration's buffer add.
    """
    out: dict[str, float] = {}
    for task in tasks:
        key = task.key
        episodes = [t for t in fresh if t.key == key]
        groups = [f for f in fills if f.group[0].key == key]
        name = f"task/{_clean(key[0])}/{_clean(key[1])}"
        out[f"{name}/episodes"] = float(len(episodes))
        if episodes:
            out[f"{name}/success_rate"] = sum(t.success for t in episodes) / len(episodes)
        out[f"{name}/all_fail_groups"] = float(sum(f.reason != NOT_FAILED for f in groups))
        out[f"{name}/replay_fills"] = float(sum(f.reason == FILLED for f in groups))
        out[f"{name}/buffer_size"] = float(buffer_sizes.get(key, 0))
    return out


@dataclass
class _Run:
    """What the phases of `train` share: the fixed inputs and the state that moves."""

    cfg: TrainConfig
    policy_cfg: PolicyConfig
    seed: int
    rollout: RolloutConfig
    pool: Any
    out_dir: Path
    run_id: str
    policy: Policy
    engine: Any
    replay: ReplayBuffer
    state: TrainState
    generator: Generator
    reference: Policy | None
    """Decision "Frozen reference policy": the frozen starting policy when train.loss.kl_coef > 0."""
    ranks: Ranks = SINGLE
    """Decision "Data-parallel ranks": this process's data-parallel rank."""
    gen_policy: Policy | None = None
    """The policy generation and evaluations run on: `policy` itself, or its unpartitioned copy under
    ZeRO-3 over several ranks (decision "Data-parallel ranks")."""
    heartbeat: Callable[[int, int | None, str], None] | None = None

    def beat(self, epoch: int, it: int | None, phase: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat(epoch, it, phase)


def _restore_or_start(
    policy_dir: str | os.PathLike,
    out_dir: Path,
    cfg: TrainConfig,
    seed: int,
    resume: bool,
    device: str = "cpu",
    preload: Sequence[Trajectory] = (),
    ranks: Ranks = SINGLE,
    *,
    success_threshold: float,
) -> tuple[Policy, Any, ReplayBuffer, TrainState, Policy | None]:
    """The last complete epoch's policy, engine, buffer, state and RNG states
    (decision "Atomic epoch checkpoints"), or a fresh start from `policy_dir` with the global RNGs seeded from
    the run seed; and the frozen reference policy when train.loss.kl_coef > 0
    (decision "Frozen reference policy"). With ranks, rank 0 picks the checkpoint and every rank loads it;
    only rank 0 holds the buffer (decision "Data-parallel ranks")."""
    ckpt = latest_checkpoint(out_dir) if resume and ranks.main else None
    ckpt = ranks.broadcast(ckpt)
    if ranks.main and resume and ckpt is None and any((out_dir / "checkpoints").glob("*")):
        # decision "Checkpoint integrity": never silently
        _log.warning(
            "no usable checkpoint in %s (see the lines above): training starts again from epoch 1 from %s",
            out_dir / "checkpoints",
            policy_dir,
        )
    if ckpt is not None:
        policy = load_policy(ckpt / "policy", device=device)
        meta = json.loads((ckpt / "state.json").read_text())
        state = TrainState(meta["epoch"], meta["policy_version"], meta["history"])
        replay = (
            ReplayBuffer.load(ckpt / "replay", config=cfg.replay, success_threshold=success_threshold)
            if ranks.main
            else ReplayBuffer(cfg.replay, success_threshold=success_threshold)
        )
    else:
        policy = load_policy(policy_dir, device=device)
        state = TrainState()
        replay = ReplayBuffer(cfg.replay, success_threshold=success_threshold)
        if cfg.replay.preload != "none" and ranks.main:
            # decision "Buffer preload": before epoch 1 only; a resumed buffer holds them
            replay.add(preload)
    policy.image_blind = cfg.image_blind  # decision "Image-blind arm"
    if cfg.gradient_checkpointing:  # model.py, decision "Gradient checkpointing"
        policy.set_gradient_checkpointing(True)
    reference = _load_reference(policy_dir, policy) if cfg.loss.kl_coef > 0 else None
    engine = make_engine(
        cfg.engine,
        policy.model,
        cfg.optimizer,
        zero_stage=cfg.zero_stage,
        ranks=ranks,
    )
    if cfg.engine == "torch":
        ranks.broadcast_params(policy.model)  # distributed.py, decision "Summed gradients"
    if ckpt is not None:
        engine.load(ckpt)
        _set_rng_state(torch.load(ckpt / "rng.pt", weights_only=False))
    else:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
    return policy, engine, replay, state, reference


class _UpdateShare(NamedTuple):
    """Decision "Data-parallel ranks": what rank 0 sends a rank for the update."""

    trajectories: list[Trajectory]
    advantages: torch.Tensor
    """(n,) one per trajectory."""
    unit_ids: list[int]
    """Each trajectory's index in the whole update batch; -1: a padding copy (zero-weight passes)."""
    n_units: int
    """Trajectories of the update, all ranks together."""
    n_batch: int
    """Trajectories of the filled batch (before zero advantages are left out): 0 = no update."""


def _shares(batch: PreparedBatch, cfg: TrainConfig, ranks: Ranks) -> list[_UpdateShare]:
    """The update batch (zero advantages left out when asked) split by trajectory over the ranks
    (distributed.py, decision "Split by trajectory"); a rank without any gets a padding copy of the first
    one."""
    adv = batch.advantages
    keep = [i for i in range(len(batch.trajectories)) if not (cfg.skip_zero_advantage and adv[i] == 0)]
    out = []
    n, b = len(keep), len(batch.trajectories)
    for ids in assign_units(n, ranks.world):
        if ids:
            picked = [keep[u] for u in ids]
            out.append(_UpdateShare([batch.trajectories[i] for i in picked], adv[picked], list(ids), n, b))
        elif keep:
            out.append(_UpdateShare([batch.trajectories[keep[0]]], adv[keep[:1]] * 0.0, [-1], n, b))
        else:
            out.append(_UpdateShare([], torch.zeros(0), [], 0, b))
    return out


def _update(run: _Run, share: _UpdateShare, epoch: int, it: int) -> dict[str, float]:
    """The policy update on this rank's share of a prepared batch (decisions "ARPO order of operations",
    "Frozen reference policy" and "Data-parallel ranks"); returns its
    metrics (over all ranks)."""
    cfg, pc, ranks = run.cfg, run.policy_cfg, run.ranks
    kept = share.trajectories
    seqs = encode_trajectories(run.policy, kept, spec=PromptSpec.of(pc))
    seq_adv = share.advantages[[s.source for s in seqs]]  # a trajectory's windows share its advantage
    t0 = time.monotonic()
    ref_logps = (
        compute_logps(run.reference, seqs, micro_batch_size=cfg.micro_batch_size, bf16=cfg.optimizer.bf16)
        if run.reference is not None
        else None
    )
    synced = callable(getattr(run.generator, "sync_weights", None))  # decision "Weight sync"
    old_logps, extra = None, {}
    if synced:
        run.generator.before_update()
        pad = 0
        if ranks.distributed and getattr(run.engine, "gathers_in_forward", False):
            calls = torch.tensor([float(-(-len(seqs) // cfg.micro_batch_size))])
            pad = int(ranks.all_reduce_max(calls)[0])  # ZeRO-3 forwards are collectives (update.py 9)
        old_logps = compute_logps(
            run.policy,
            seqs,
            micro_batch_size=cfg.micro_batch_size,
            bf16=cfg.optimizer.bf16,
            module=run.engine.module,
            pad_to=pad,
        )
        real = [i for i, u in enumerate(share.unit_ids) if u >= 0]
        units = trajectory_units(seqs)
        extra = logprob_gap(
            [kept[i] for i in real],
            [seqs[j] for i in real for j in units[i]],
            [old_logps[j] for i in real for j in units[i]],
        )
        extra = _reduce_gap(ranks, extra)
    stats = ppo_update(
        run.policy,
        run.engine,
        seqs,
        seq_adv,
        cfg,
        seed=derive_seed("minibatch", run.seed, epoch, it),
        old_logps=old_logps,
        ref_logps=ref_logps,
        shard=Shard(ranks, share.unit_ids, share.n_units) if ranks.distributed else None,
    )
    if synced:
        t1 = time.monotonic()
        run.generator.sync_weights(run.policy.model)
        extra["time/weight_sync_s"] = time.monotonic() - t1
    return stats.as_metrics() | {"time/update_s": time.monotonic() - t0} | extra


def _reduce_gap(ranks: Ranks, gap: dict[str, float]) -> dict[str, float]:
    """The diagnostic of decision "Weight sync" over all ranks: maxima of the maxima, the per-token mean
    weighted by the
    replies compared."""
    if not ranks.distributed:
        return gap
    n = gap.get("logprob/replies_compared", 0.0)
    vec = torch.tensor(
        [
            gap.get("logprob/gen_vs_train_max_abs", 0.0),
            gap.get("logprob/gen_vs_train_max_abs_per_token", 0.0),
        ]
    )
    maxima = ranks.all_reduce_max(vec)
    sums = ranks.all_reduce_sum(
        torch.tensor([gap.get("logprob/gen_vs_train_mean_abs_per_token", 0.0) * n, n])
    )
    if float(sums[1]) == 0:
        return {}
    return {
        "logprob/gen_vs_train_max_abs": float(maxima[0]),
        "logprob/gen_vs_train_max_abs_per_token": float(maxima[1]),
        "logprob/gen_vs_train_mean_abs_per_token": float(sums[0] / sums[1]),
        "logprob/replies_compared": float(sums[1]),
    }


def logprob_gap(
    trajectories: Sequence[Trajectory], seqs: Sequence[Any], logps: Sequence[torch.Tensor]
) -> dict[str, float]:
    """Decision "Weight sync"'s diagnostic: the generator's summed log-prob of each fresh reply
    (`gen_logprob_sum`) against the trainer's recomputation (`logps`, one (L_i,) tensor per sequence of
    `seqs`; a trajectory's windows, update.py, decision "Windowed trajectories", in step order). Replayed
    trajectories (an older policy's) and replies without sampled tokens are left out."""
    if len(logps) != len(seqs):
        raise ValueError(f"{len(logps)} log-prob rows for {len(seqs)} sequences")
    units = trajectory_units(seqs)
    if len(units) != len(trajectories):
        raise ValueError(f"{len(units)} trajectories in the sequences, {len(trajectories)} given")
    diffs: list[tuple[float, int]] = []
    for traj, members in zip(trajectories, units, strict=True):
        sums = [r for i in members for r in reply_logprob_sums(seqs[i].assistant_mask, logps[i])]
        if traj.replayed:
            continue
        steps = [s for s in traj.steps if s.train_reply]
        if len(sums) != len(steps):
            continue
        diffs += [
            (abs(total - s.gen_logprob_sum), n)
            for (total, n), s in zip(sums, steps, strict=True)
            if s.response_token_ids
        ]
    if not diffs:
        return {}
    per_token = [d / n for d, n in diffs]
    return {
        "logprob/gen_vs_train_max_abs": max(d for d, _ in diffs),
        "logprob/gen_vs_train_max_abs_per_token": max(per_token),
        "logprob/gen_vs_train_mean_abs_per_token": sum(d for d, _ in diffs) / sum(n for _, n in diffs),
        "logprob/replies_compared": float(len(diffs)),
    }


def _run_iteration(
    run: _Run, epoch: int, it: int, chunk: Sequence[TaskSpec], progress_factory: Callable[..., Any] | None
) -> dict[str, float]:
    """rollout -> prepare_batch (replay fill + advantages) -> update -> buffer add -> write trajectories.
    With ranks (decision "Data-parallel ranks") each rank plays its groups, rank 0 does the batch work, every
    rank updates
    on its share; the metrics are rank 0's (an empty dict elsewhere)."""
    t0 = time.monotonic()
    cfg, ranks = run.cfg, run.ranks
    env_seed = derive_seed("env", run.seed, epoch, it, bits=ENV_SEED_BITS)  # decision "Derived randomness"
    jobs = make_group_jobs(chunk, cfg.group_size, seed=env_seed, groups_per_task=cfg.groups_per_task)
    mine = split_jobs(jobs, ranks.world, ranks.rank) if ranks.distributed else list(enumerate(jobs))
    bar = (
        progress_factory(total=len(mine), desc=f"epoch {epoch} iter {it} rollout")
        if progress_factory and ranks.main
        else None
    )
    run.beat(epoch, it, "rollout")
    res = run_episodes(
        run.pool,
        run.generator,
        [j for _, j in mine],
        run.rollout,
        run_id=run.run_id,
        stage="train",
        epoch=epoch,
        iteration=it,
        policy_version=run.state.policy_version,
        progress=bar,
        orders=[i for i, _ in mine],
    )
    if bar is not None:
        bar.close()
    parts = ranks.gather(res)
    batch = None
    if ranks.main:
        assert parts is not None
        res = merge_results(parts)
        batch = prepare_batch(
            res.trajectories,
            run.replay,
            cfg.group_size,
            scale=cfg.loss.advantage_scale,
            eps=cfg.loss.advantage_eps,
        )
    run.beat(epoch, it, "update")
    share = ranks.scatter(_shares(batch, cfg, ranks) if batch is not None else None)
    metrics: dict[str, float] = dict(res.metrics) if ranks.main else {}
    if share.n_batch:
        metrics.update(_update(run, share, epoch, it))
        run.state.policy_version += 1
    if not ranks.main:
        return {}
    assert batch is not None
    if batch.trajectories:
        metrics["train/nonzero_adv_frac"] = float((batch.advantages != 0).float().mean())
    # decision "ARPO order of operations": after the update, fresh rollouts only
    run.replay.add(res.trajectories)
    metrics.update(run.replay.stats().as_metrics())
    metrics.update(task_metrics(chunk, res.trajectories, batch.fills, run.replay.sizes()))
    metrics["train/groups"] = float(batch.n_groups)
    metrics["train/replayed"] = float(batch.n_replayed)
    metrics["time/iteration_s"] = time.monotonic() - t0
    if batch.trajectories:
        path = run.out_dir / "trajectories" / f"epoch-{epoch:04d}-iter-{it:03d}.parquet"
        write_trajectories(path, batch.trajectories)
    return metrics


def _end_epoch(
    run: _Run,
    epoch: int,
    rows: Sequence[dict[str, float]],
    on_epoch: Callable[[int, Policy], dict[str, Any] | None] | None,
) -> None:
    """The epoch's summary (decision "Epoch summary reduction") plus `on_epoch`'s metrics into the history,
    then the checkpoint (decision "Atomic epoch checkpoints")."""
    summary: dict[str, Any] = epoch_summary(rows)
    summary["epoch"] = epoch
    summary["policy_version"] = run.state.policy_version
    if on_epoch is not None:
        run.beat(epoch, None, "evaluation")
        summary.update(on_epoch(epoch, run.gen_policy or run.policy) or {})
    run.state.history.append(summary)
    run.state.epoch = epoch
    run.beat(epoch, None, "checkpoint")
    _save_checkpoint(run.out_dir, run.policy, run.engine, run.replay, run.state, run.ranks)


class _OnCopy:
    """Decision "Data-parallel ranks": generation on an unpartitioned copy of a policy ZeRO-3 shards over
    several ranks
    (every forward of the sharded one is a collective, and ranks sample different prompts). Synced from
    the gathered weights after every update, through the path of decision "Weight sync"."""

    def __init__(self, inner: Any, copy: Policy, engine: Any) -> None:
        self.inner, self.copy, self.engine = inner, copy, engine

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.generate(*args, **kwargs)

    def before_update(self) -> None:
        if callable(getattr(self.inner, "before_update", None)):
            self.inner.before_update()

    def sync_weights(self, model: torch.nn.Module) -> None:
        with self.engine.full_weights(), torch.no_grad():  # a collective: every rank calls it
            for p, q in zip(model.parameters(), self.copy.model.parameters(), strict=True):
                q.copy_(p.data.to(q.device, q.dtype))
        if callable(getattr(self.inner, "sync_weights", None)):
            self.inner.sync_weights(self.copy.model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def train(
    policy_dir: str | os.PathLike,
    tasks: Sequence[TaskSpec],
    out_dir: str | os.PathLike,
    cfg: TrainConfig,
    policy_cfg: PolicyConfig,
    pool,
    *,
    seed: int,
    rollout: RolloutConfig,
    resume: bool = True,
    run_id: str = "train",
    on_iteration: Callable[[int, int, dict[str, float]], None] | None = None,
    on_epoch: Callable[[int, Policy], dict[str, Any] | None] | None = None,
    progress_factory: Callable[..., Any] | None = None,
    generator_factory: Callable[[Policy], Any] | None = None,
    device: str = "cpu",
    preload: Sequence[Trajectory] = (),
    ranks: Ranks = SINGLE,
    heartbeat_dir: str | os.PathLike | None = None,
    success_threshold: float,
) -> TrainState:
    """Train from `policy_dir` (or resume from `out_dir`'s last checkpoint) for `cfg.epochs` epochs.

    Args:
        cfg: params' `train` section; policy_cfg: its `policy` section (prompt, history window).
        pool: an `EnvPool` (or anything with its submit_* API).
        seed: the run seed (`project.seed`), root of every derived seed (decision "Derived randomness").
        success_threshold: what the buffer stores as a success (`project.success_threshold`).
        rollout: how training episodes are played (sampling, step limit, pixels), built from params.
        generator_factory: policy -> Generator; default `HFGenerator` with policy_cfg's prompt. A
            generator with `sync_weights` gets the weights after every update (decision "Weight sync").
        device: where the trained policy is loaded ("cuda" with the vLLM backend: colocated).
        preload: trajectories whose successes of `tasks` fill the buffer before epoch 1 when
            `cfg.replay.preload` is not 'none' (decision "Buffer preload").
        ranks: this process's data-parallel rank (decision "Data-parallel ranks"); `on_iteration`, `on_epoch`
            and `progress_factory` are only called on rank 0, and only rank 0's returned history is whole.
        heartbeat_dir: where each rank reports its phase (distributed.py, decision "Rank heartbeats"); None:
            nowhere.

    Trajectories go to `out_dir/trajectories/epoch-EEEE-iter-III.parquet` (filled groups, replayed flag
    set), checkpoints to `out_dir/checkpoints/`. Returns the final state (its history has one entry per
    epoch).
    """
    out_dir = Path(out_dir)
    keys = {t.key for t in tasks}
    policy, engine, replay, state, reference = _restore_or_start(
        policy_dir,
        out_dir,
        cfg,
        seed,
        resume,
        device,
        [t for t in preload if t.key in keys],
        ranks,
        success_threshold=success_threshold,
    )
    gen_policy = policy
    if ranks.distributed and getattr(engine, "gathers_in_forward", False):  # decision "Data-parallel ranks"
        dtype = next(policy.model.parameters()).dtype  # the engine's (bf16 under DeepSpeed's bf16)
        gen_policy = load_policy(policy_dir, device=device, dtype=dtype)
        gen_policy.image_blind = policy.image_blind
    generator = (
        generator_factory(gen_policy)
        if generator_factory is not None
        else HFGenerator.of(gen_policy, policy_cfg)
    )
    if gen_policy is not policy:
        generator = _OnCopy(generator, gen_policy, engine)
        generator.sync_weights(policy.model)  # the checkpoint's weights on a resume
    run = _Run(
        cfg=cfg,
        policy_cfg=policy_cfg,
        seed=seed,
        rollout=rollout,
        pool=pool,
        out_dir=out_dir,
        run_id=run_id,
        policy=policy,
        engine=engine,
        replay=replay,
        state=state,
        generator=generator,
        reference=reference,
        ranks=ranks,
        gen_policy=gen_policy,
        heartbeat=Heartbeat(heartbeat_dir, ranks) if heartbeat_dir is not None else None,
    )
    if not ranks.main:
        on_iteration = on_epoch = progress_factory = None
    for epoch in range(state.epoch + 1, cfg.epochs + 1):
        rows = []
        for it, chunk in enumerate(_iteration_chunks(tasks, cfg.tasks_per_iteration, seed, epoch)):
            rows.append(_run_iteration(run, epoch, it, chunk, progress_factory))
            if on_iteration is not None:
                on_iteration(epoch, it, rows[-1])
        _end_epoch(run, epoch, rows, on_epoch)
    run.beat(state.epoch, None, "done")
    return state


_SUMMED = ("rollout/episodes", "rollout/env_faults", "rollout/failed_jobs", "train/groups", "train/replayed")
_PER_EPISODE = (
    "rollout/success_rate",
    "rollout/format_error_rate",
    "rollout/mean_steps",
    "rollout/mean_reward",
)
_TASK_SUMMED = ("episodes", "all_fail_groups", "replay_fills", "env_faults")


def _reduction(key: str) -> tuple[str, str | None]:
    """How decision "Epoch summary reduction" reduces `key` over an epoch's rows: ('sum' | 'last' | 'max' |
    'mean', None) or ('per_episode', the key of its episode count)."""
    if key.startswith("task/"):
        task, _, name = key.rpartition("/")
        if name in _TASK_SUMMED:
            return "sum", None
        if name == "success_rate":
            return "per_episode", f"{task}/episodes"
        if name == "buffer_size":
            return "last", None
    if key in _SUMMED or key.startswith("rollout/faults/"):
        return "sum", None
    if key in _PER_EPISODE:
        return "per_episode", "rollout/episodes"
    if key.startswith("replay/"):
        return "last", None
    if key.startswith("logprob/") and "max" in key:
        return "max", None
    return "mean", None


def epoch_summary(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Decision "Epoch summary reduction": an epoch's iteration rows (in order) -> one flat row of floats."""
    out: dict[str, float] = {}
    for key in sorted({k for r in rows for k in r}):
        held = [r for r in rows if key in r]
        rule, weight_key = _reduction(key)
        values = [float(r[key]) for r in held]
        if rule == "sum":
            out[key] = float(sum(values))
        elif rule == "last":
            out[key] = values[-1]
        elif rule == "max":
            out[key] = max(values)
        elif rule == "per_episode":
            weights = [float(r.get(weight_key, 0.0)) for r in held]
            total = sum(weights)
            # no episode at all: every rate is the rollout's 0.0 placeholder; keep the plain mean
            out[key] = (
                sum(w * v for w, v in zip(weights, values, strict=True)) / total
                if total
                else float(np.mean(values))
            )
        else:
            out[key] = float(np.mean(values))
    return out
