"""ARPO experience replay: per-task successful trajectories that rescue all-failed GRPO groups.

A GRPO group whose rollouts all failed has zero reward variance, hence zero advantages and no gradient
(docs/method.md §1, §7: 35% of groups in the prototype). ARPO keeps, per task, the most recent successful
trajectories and swaps one of them into such a group so the group has a success to learn from.

Reference implementation read for this module (ARPO's EasyR1/verl fork, as stored in ARPO-derived
repositories, e.g. super-jw/DA-GRPO `verl/trainer/replay_buffer.py` and the `apply_replay` method of
ARPO's `verl/trainer/ray_trainer.py`): `update_replay_buffer` appends an item when `eval_result > 0.1`
and pops index 0 past `buffer_size`; `apply_replay` computes `np.std` / `np.mean` of each group's
`eval_results`, calls `get_pos(task_id, 1)` (`random.choices`, uniform) when `std < 0.05 and
mean < 0.2`, puts the drawn item FIRST and drops the group's first fresh rollout, and only then calls
`update_replay_buffer_batch(task_configs, batch)` with the FRESH batch.

Decisions:
- **Task key.** Keyed by `Trajectory.key` = (task_domain, task_id): OSWorld ids repeat across domains, and the
  reference keys by id alone (a known defect, docs/method.md §1).
- **Storage rule.** Stored: trajectories whose signal > `success_threshold` (strictly; exactly 0.1 is not
  stored), at most `capacity_per_task` per key, oldest evicted first (the reference's append + pop(0)).
- **Replay signal.** Signal: the reference triggers and stores on the environment checker's score
  (`eval_results`), not on the trained reward (success + 0.5 * format term). `ReplayConfig.signal` picks
  `"success"` (the reference, default) or `"reward"`; they differ only when a format penalty or reward shaping
  is on.
- **Trigger rule.** Trigger: population std (ddof=0, `np.std` in the reference) < `trigger_std` and mean <
  `trigger_mean`. Note that the GRPO advantage uses the unbiased std; the trigger does not.
- **Slot zero replacement.** Slot: the replayed trajectory replaces slot 0 (the reference prepends it and
  drops `cur_batch[:1]`). The copy is marked `replayed=True`, keeps its stored reward, success, steps,
  token ids and `policy_version` (its behaviour policy, so staleness = current - policy_version), and
  takes the slot's run_id / stage / epoch / group_id / sample_idx so it sits in this batch's group.
- **Seeded draws.** Draw: uniform over the key's stored items with the buffer's own seeded `random.Random`;
  its state is saved, so a resumed run makes the same draws as an uninterrupted one. The reference uses the
  global `random` module (unseeded, not checkpointed).
- **No re-storing.** Replayed items are never re-stored: as in the reference the buffer is updated with the
  fresh batch (call `add` with the fresh rollouts after `apply`), and `add` also skips `replayed=True` items
  and items already stored (same run/stage/epoch/group/sample/policy version), so passing the filled
  groups by mistake cannot grow the buffer with copies of itself.
- **Disabled buffer counts.** `enabled=False` (the GRPO ablation; the reference's flag is read by nothing)
  leaves every group unchanged and draws nothing, but still counts failed groups and "fillable" ones (a stored
  success existed), so the ablation reports how often replay would have acted.
- **Persistence.** Persistence: a Parquet file of the stored trajectories (PNG bytes and token ids, never
  pixel tensors) plus `manifest.json` with config, RNG state, counters, and the per-key FIFO order
  (rewards round-trip exactly: the Parquet schema stores them as float64). The Parquet file has a fresh name
  per save and the manifest is replaced atomically last, so a crash mid-save leaves the previous save
  loadable; superseded Parquet files are deleted only after the new manifest is in place.
"""

from __future__ import annotations

import json
import math
import os
import random
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

from arpo_core.config.sections import ReplayConfig
from arpo_core.infra.fileio import atomic_write_text
from arpo_core.trajectory import Trajectory, read_trajectories, write_trajectories

__all__ = [
    "FillResult",
    "ReplayBuffer",
    "ReplayConfig",
    "ReplayStats",
    "group_failed",
    "population_std",
]

Key = tuple[str, str]
MANIFEST = "manifest.json"
_FORMAT_VERSION = 1

# FillResult.reason values.
FILLED = "filled"
DISABLED = "disabled"
NOT_FAILED = "not_failed"
NO_STORED_SUCCESS = "no_stored_success"


class FillResult(NamedTuple):
    """Outcome of `ReplayBuffer.fill_group` for one group."""

    group: list[Trajectory]
    """The group to train on: a new list (the input list is never modified)."""
    replaced_slot: int | None
    """Index of the fresh rollout that was replaced by a replayed success; None when unchanged."""
    reason: str
    """'filled', 'disabled' (failed, replay off), 'not_failed' or 'no_stored_success'."""


class ReplayStats(NamedTuple):
    """Counters since the buffer was created (they survive save/load)."""

    n_tasks: int
    """Keys holding at least one stored success."""
    n_items: int
    """Stored trajectories over all keys."""
    groups_seen: int
    groups_failed: int
    """Groups that met the trigger (std < trigger_std and mean < trigger_mean)."""
    groups_fillable: int
    """Failed groups whose task had a stored success (filled when enabled)."""
    groups_filled: int
    fill_rate: float
    """groups_filled / groups_failed (0.0 when no group failed)."""
    failed_rate: float
    """groups_failed / groups_seen (0.0 when no group was seen)."""
    n_added: int
    """Trajectories ever stored."""
    n_evicted: int
    """Trajectories dropped by FIFO eviction."""

    def as_metrics(self) -> dict[str, float]:
        """The stats under the project's `replay/` metric namespace (docs/design.md, the 1:1:1 rule)."""
        return {f"replay/{k}": float(v) for k, v in self._asdict().items()}


def population_std(values: Sequence[float]) -> float:
    """Standard deviation with ddof=0, as `np.std` in the reference trigger. Empty -> 0.0."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def group_failed(values: Sequence[float], trigger_std: float, trigger_mean: float) -> bool:
    """ARPO's all-failed test: population std < trigger_std and mean < trigger_mean."""
    if not values:
        return False
    return population_std(values) < trigger_std and sum(values) / len(values) < trigger_mean


def _identity(t: Trajectory) -> tuple:
    """What makes two stored trajectories the same rollout (used to refuse duplicates)."""
    return (t.run_id, t.stage, t.epoch, t.task_domain, t.task_id, t.group_id, t.sample_idx, t.policy_version)


def _rng_state_to_json(state: tuple) -> list:
    version, internal, gauss_next = state
    return [version, list(internal), gauss_next]


def _rng_state_from_json(data: list) -> tuple:
    version, internal, gauss_next = data
    return (version, tuple(internal), gauss_next)


class ReplayBuffer:
    """Per-task FIFO store of successful trajectories and the ARPO group filling rule.

    Typical use per iteration (docs/method.md §1: the buffer is updated after replay is applied):

        results = buffer.apply(groups)          # groups: list of G-trajectory lists, one task each
        train_groups = [r.group for r in results]
        buffer.add(t for g in groups for t in g)   # the fresh rollouts
    """

    def __init__(self, config: ReplayConfig | None = None, *, success_threshold: float) -> None:
        self.config = config or ReplayConfig()
        self.success_threshold = success_threshold
        """Stored: a signal strictly above this (params `project.success_threshold`, the one key)."""
        self._items: dict[Key, deque[Trajectory]] = {}
        self._rng = random.Random(self.config.seed)
        self._groups_seen = 0
        self._groups_failed = 0
        self._groups_fillable = 0
        self._groups_filled = 0
        self._n_added = 0
        self._n_evicted = 0

    # ---------------------------------------------------------------- store

    def _signal(self, t: Trajectory) -> float:
        return float(t.success if self.config.signal == "success" else t.reward)

    def add(self, trajs: Iterable[Trajectory]) -> int:
        """Store the successes among `trajs` (signal > success_threshold) under their key.

        Skips replayed copies and trajectories already stored. Evicts the oldest item of a key beyond
        `capacity_per_task`. Returns how many were stored.
        """
        stored = 0
        for t in trajs:
            if t.replayed or not self._signal(t) > self.success_threshold:
                continue
            items = self._items.setdefault(t.key, deque())
            ident = _identity(t)
            if any(_identity(s) == ident for s in items):
                continue
            # A shallow copy: later changes to the caller's object do not reach the buffer.
            items.append(replace(t, steps=list(t.steps)))
            stored += 1
            self._n_added += 1
            while len(items) > self.config.capacity_per_task:
                items.popleft()
                self._n_evicted += 1
        return stored

    def items(self, key: Key) -> list[Trajectory]:
        """Stored trajectories of one key, oldest first (copies of the list, not of the items)."""
        return list(self._items.get(tuple(key), ()))

    def sizes(self) -> dict[Key, int]:
        """Number of stored trajectories per key (keys with none are absent)."""
        return {k: len(v) for k, v in self._items.items() if v}

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())

    def __contains__(self, key: object) -> bool:
        return bool(self._items.get(key))  # type: ignore[arg-type]

    # ----------------------------------------------------------------- fill

    def fill_group(self, group: Sequence[Trajectory]) -> FillResult:
        """Apply ARPO replay to one group of rollouts of one task.

        If the group failed (population std of signals < trigger_std and mean < trigger_mean), replay is
        enabled and a success of the task is stored, one is drawn uniformly and a copy marked
        `replayed=True` replaces slot 0. Otherwise the group is returned unchanged (as a new list).
        Raises ValueError for an empty group or one mixing keys.
        """
        if not group:
            raise ValueError("fill_group got an empty group")
        keys = {t.key for t in group}
        if len(keys) != 1:
            raise ValueError(f"a group must hold rollouts of one task, got keys {sorted(keys)}")
        (key,) = keys
        out = list(group)
        self._groups_seen += 1
        cfg = self.config
        if not group_failed([self._signal(t) for t in group], cfg.trigger_std, cfg.trigger_mean):
            return FillResult(out, None, NOT_FAILED)
        self._groups_failed += 1
        stored = self._items.get(key)
        if not stored:
            return FillResult(out, None, NO_STORED_SUCCESS)
        self._groups_fillable += 1
        if not cfg.enabled:
            return FillResult(out, None, DISABLED)
        pick = stored[self._rng.randrange(len(stored))]
        slot = 0  # the reference prepends the replayed item and drops the first fresh rollout
        fresh = out[slot]
        out[slot] = replace(
            pick,
            steps=list(pick.steps),
            replayed=True,
            run_id=fresh.run_id,
            stage=fresh.stage,
            epoch=fresh.epoch,
            group_id=fresh.group_id,
            sample_idx=fresh.sample_idx,
        )
        self._groups_filled += 1
        return FillResult(out, slot, FILLED)

    def apply(self, groups: Iterable[Sequence[Trajectory]]) -> list[FillResult]:
        """`fill_group` over many groups, in order. Then call `add` with the fresh rollouts."""
        return [self.fill_group(g) for g in groups]

    # ---------------------------------------------------------------- stats

    def stats(self) -> ReplayStats:
        failed, seen = self._groups_failed, self._groups_seen
        return ReplayStats(
            n_tasks=len(self.sizes()),
            n_items=len(self),
            groups_seen=seen,
            groups_failed=failed,
            groups_fillable=self._groups_fillable,
            groups_filled=self._groups_filled,
            fill_rate=self._groups_filled / failed if failed else 0.0,
            failed_rate=failed / seen if seen else 0.0,
            n_added=self._n_added,
            n_evicted=self._n_evicted,
        )

    # ---------------------------------------------------------- persistence

    def save(self, directory: str | os.PathLike) -> Path:
        """Save to `directory` (created if needed); atomic: the manifest is replaced last."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        order = [(k, list(v)) for k, v in self._items.items() if v]
        flat = [t for _, items in order for t in items]
        items_file = None
        if flat:
            items_file = f"items-{uuid.uuid4().hex[:12]}.parquet"
            write_trajectories(directory / items_file, flat)
        manifest = {
            "format_version": _FORMAT_VERSION,
            "config": asdict(self.config),
            "success_threshold": self.success_threshold,
            "items_file": items_file,
            "order": [
                {
                    "key": list(k),
                    "n": len(items),
                }
                for k, items in order
            ],
            "rng_state": _rng_state_to_json(self._rng.getstate()),
            "counters": {
                "groups_seen": self._groups_seen,
                "groups_failed": self._groups_failed,
                "groups_fillable": self._groups_fillable,
                "groups_filled": self._groups_filled,
                "n_added": self._n_added,
                "n_evicted": self._n_evicted,
            },
        }
        atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
        # Only now is the previous items file unreferenced.
        for old in directory.glob("items-*.parquet"):
            if old.name != items_file:
                old.unlink(missing_ok=True)
        return directory

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        config: ReplayConfig | None = None,
        success_threshold: float | None = None,
    ) -> ReplayBuffer:
        """Load a buffer saved by `save`. `config` and `success_threshold` override the saved ones (e.g.
        to switch replay on); a smaller capacity evicts the oldest items of each key. A buffer saved
        before the threshold left its config keeps the threshold its config held."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"no replay buffer at {directory} (missing {MANIFEST})")
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported format_version {manifest.get('format_version')!r}")
        saved = dict(manifest["config"])
        saved_threshold = manifest.get("success_threshold", saved.pop("success_threshold", None))
        saved.pop("success_threshold", None)
        threshold = success_threshold if success_threshold is not None else saved_threshold
        if threshold is None:
            raise ValueError(f"{path}: no success_threshold saved and none given")
        buf = cls(config or ReplayConfig(**saved), success_threshold=float(threshold))
        flat = read_trajectories(directory / manifest["items_file"]) if manifest["items_file"] else []
        expected = sum(e["n"] for e in manifest["order"])
        if len(flat) != expected:
            raise ValueError(
                f"{directory}: manifest lists {expected} trajectories, Parquet holds {len(flat)}"
            )
        it = iter(flat)
        for entry in manifest["order"]:
            key = (entry["key"][0], entry["key"][1])
            items: deque[Trajectory] = deque()
            for _ in range(entry["n"]):
                t = next(it)
                if t.key != key:
                    raise ValueError(f"{directory}: Parquet order does not match manifest at key {key}")
                items.append(t)
            buf._items[key] = items
        buf._rng.setstate(_rng_state_from_json(manifest["rng_state"]))
        c = manifest["counters"]
        buf._groups_seen = c["groups_seen"]
        buf._groups_failed = c["groups_failed"]
        buf._groups_fillable = c["groups_fillable"]
        buf._groups_filled = c["groups_filled"]
        buf._n_added = c["n_added"]
        buf._n_evicted = c["n_evicted"]
        for items in buf._items.values():
            while len(items) > buf.config.capacity_per_task:
                items.popleft()
                buf._n_evicted += 1
        return buf
