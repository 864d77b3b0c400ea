"""Data-parallel training across ranks: who plays which group, who owns the buffer, how a mini-batch
is split, and the few collectives that make R ranks compute what one process computes.

Decisions:
- **Standard launchers.** Standard launch, no launcher of our own: `torchrun` (or the `deepspeed` launcher)
  starts R copies of `arpo stage train`, one per GPU or CPU slot, on one or several nodes, and sets RANK /
  WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. `Ranks.from_env` joins that process group (NCCL on
  GPUs, gloo on CPU) with a collective timeout (`train.distributed.timeout_s`): a rank that hangs ends the job
  with a timeout error instead of hanging it, and a rank that dies is seen at once by torchrun, which stops
  the others. Without those variables there is no process group at all (`SINGLE`): one process, exactly the
  code path of a run that never heard of ranks.
- **Whole groups per rank.** A group never spans ranks (`split_jobs`): rank r plays groups r, r + R, r + 2R,
  ... of the iteration's job list, with the jobs' GLOBAL indices, so every reply draws the seed it would draw
  in one process (rollout.py, decision "Per-step sampling seeds") and the same job list gives the same
  trajectories with any R.
- **One buffer owner.** One buffer, one owner: rank 0 gathers the iteration's trajectories (`gather`), merges
  them back into job order and runs the one-process code on them - replay fill, group advantages, the buffer
  add, metrics, the trajectories file - then sends each rank its share of the filled batch (`scatter`).
  Rewards, advantages, replay fills and selection are therefore those of the one-process run; only rank 0
  checkpoints the buffer.
- **Split by trajectory.** The update is split by trajectory, not by group (`assign_units`): trajectory i of
  the filled batch goes to rank i mod R. Every rank draws the same mini-batch order over ALL trajectories (the
  "minibatch" seed) and, per mini-batch, trains on the trajectories it holds. The loss is normalised globally:
  token-mean divides by the mini-batch's masked tokens summed over ranks, the seq-mean modes by its
  trajectories over all ranks (update.py, decision "Global normalisation"), and gradients are summed over
  ranks, so a mini-batch spread over R ranks gives the gradient of the same mini-batch in one process (up to
  float summation order).
- **Summed gradients.** Gradient reduction: the torch engine all-reduces (sums) every gradient before clipping
  and the step, as DDP does, but once per optimizer step (no bucketing; on GPUs DDP would overlap it with the
  backward); DeepSpeed reduces itself and AVERAGES over its data-parallel ranks, so its engine scales the loss
  by R first (engines.py). The parameters are broadcast from rank 0 once at the start.
- **ZeRO-3 lockstep.** Lockstep for ZeRO-3: every forward of a ZeRO-3 model gathers its shards from all ranks,
  so all ranks must run the same number of forwards. The update pads each rank's micro-batches of a mini-batch
  to the largest count over ranks with zero-weight passes over one of its own sequences (`lockstep` plans),
  and generation runs on an unpartitioned copy of the policy that receives the weights after every update
  (trainer.py, decision "Weight sync"), because a rank's sampling loop cannot be kept in step with another's.
- **Clean exit.** A run that ended well leaves the process group (`Ranks.close`: a barrier, then
  `destroy_process_group`) before the process ends. A rank that exits with the group alive leaves its
  teardown to the interpreter's exit, and once, on a loaded machine, a DeepSpeed ZeRO-2 rank aborted
  there ("terminate called without an active exception", SIGABRT): a finished job reported as a killed
  rank (tests/test_distributed.py, one CI run in many). A run that failed does not wait at the barrier:
  the launcher stops its ranks.
- **Rank heartbeats.** Ranks report where they are (`Heartbeat`): each rank rewrites `<dir>/rank-<r>.json`
  (epoch, iteration, phase, pid, time) at every phase, so when a rank dies the launcher's failure can be
  turned into one line naming the rank and its last step (`describe_failure`).
- **Memory per rank.** docs/scale-out.md's per-GPU memory table is computed, not typed: `model_state_bytes`
  gives the model states of one rank from the parameter count, the engine and the ZeRO stage (16 bytes a
  parameter in all: bf16 weights and gradients, fp32 master weights and AdamW moments; ZeRO-1 shards the
  optimizer states, ZeRO-2 the gradients too, ZeRO-3 the weights too), and a test checks the numbers against
  hand-computed ones and the table against the function.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

__all__ = [
    "SINGLE",
    "Heartbeat",
    "Ranks",
    "assign_units",
    "describe_failure",
    "launch_ranks",
    "model_state_bytes",
    "split_jobs",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks, and the collectives the trainer needs."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: owns the buffer, the outputs, the logs (decision "One buffer owner")."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls, timeout_s: float, backend: str) -> Ranks:
        """Decision "Standard launchers": join the launcher's process group (idempotent), or `SINGLE` without
        a launcher."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return SINGLE
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if not torch.distributed.is_initialized():
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(local)
            torch.distributed.init_process_group(
                backend=backend, timeout=datetime.timedelta(seconds=timeout_s)
            )
        return cls(rank, world, local)

    # -- collectives (no-ops in one process) ---------------------------------------------------------

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.distributed.get_backend() == "nccl"
            else torch.device("cpu")
        )

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks of a float tensor (a new tensor on the input's device)."""
        if not self.distributed:
            return values.clone()
        buf = values.detach().to(self._device(), torch.float64)
        torch.distributed.all_reduce(buf)
        return buf.to(values.device, values.dtype)

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over ranks (lockstep counts, decision "ZeRO-3 lockstep")."""
        if not self.distributed:
            return values.clone()
        buf = values.detach().to(self._device(), torch.float64)
        torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX)
        return buf.to(values.device, values.dtype)

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Decision "Summed gradients": sum every parameter's gradient over ranks in place (a missing
        gradient counts as
        zero and is created), one flat buffer per call."""
        if not self.distributed or not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).to(torch.float32) for p in params]).to(self._device())
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad).to(p.grad.device, p.grad.dtype))
            offset += n

    def broadcast_params(self, module: torch.nn.Module) -> None:
        """Decision "Summed gradients": every rank starts from rank 0's weights (buffers included)."""
        if not self.distributed:
            return
        dev = self._device()
        for t in [*module.parameters(), *module.buffers()]:
            buf = t.data.to(dev)
            torch.distributed.broadcast(buf, src=0)
            t.data.copy_(buf.to(t.device))

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's `obj` on rank 0 (in rank order); None elsewhere. Pickled, so trajectories with
        their PNG bytes travel as they are."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.main else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    def scatter(self, objs: Sequence[T] | None) -> T:
        """Rank r receives `objs[r]` from rank 0 (`objs` is only read on rank 0)."""
        if not self.distributed:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        torch.distributed.scatter_object_list(out, list(objs) if self.main else None, src=0)
        return out[0]

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def close(self) -> None:
        """Decision "Clean exit": wait for every rank, then leave the process group (idempotent; nothing in
        one process)."""
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


SINGLE = Ranks()
"""One process, no process group: what every front door runs unless a launcher started ranks."""


def split_jobs(jobs: Sequence[T], world: int, rank: int) -> list[tuple[int, T]]:
    """Decision "Whole groups per rank": (global index, job) of the jobs rank `rank` plays: whole groups,
    round-robin.

    `jobs` are group-contiguous with a `group_id` attribute (rollout.py `make_group_jobs`)."""
    groups: list[int] = []
    for job in jobs:
        g = job.group_id  # type: ignore[attr-defined]
        if not groups or groups[-1] != g:
            groups.append(g)
    mine = set(groups[rank::world])
    return [(i, job) for i, job in enumerate(jobs) if job.group_id in mine]  # type: ignore[attr-defined]


def assign_units(n_units: int, world: int) -> list[list[int]]:
    """Decision "Split by trajectory": the trajectory indices each rank trains on (i mod R)."""
    return [list(range(r, n_units, world)) for r in range(world)]


class TrainingMemory(NamedTuple):
    """Bytes per GPU of the model states of one data-parallel rank (decision "Memory per rank")."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_state_bytes(n_params: int, world: int, engine: str, zero_stage: int = 0) -> TrainingMemory:
    """Decision "Memory per rank": what the weights, gradients and optimizer states of `n_params` trained
    parameters take on each of `world` ranks (activations, the vLLM engine and buffers not included).

    DeepSpeed with bf16 keeps bf16 weights and gradients (2 + 2 bytes a parameter) and, for AdamW, an
    fp32 master copy and two fp32 moments (12 bytes): ZeRO-1 shards the 12, ZeRO-2 also the gradients,
    ZeRO-3 also the weights (Rajbhandari et al. 2020, Fig. 1). The torch engine trains fp32 weights
    (autocast computes in bf16) with fp32 gradients and two fp32 moments, 16 bytes, and shards nothing.
    """
    if engine == "torch":
        return TrainingMemory(4.0 * n_params, 4.0 * n_params, 8.0 * n_params)
    if engine != "deepspeed" or not 0 <= zero_stage <= 3:
        raise ValueError(f"no memory model for engine {engine!r} at ZeRO stage {zero_stage}")
    shard = [1, 1, 1]  # weights, gradients, optimizer: divided over the ranks from which stage on
    for i, stage in enumerate((3, 2, 1)):
        if zero_stage >= stage:
            shard[i] = world
    return TrainingMemory(2.0 * n_params / shard[0], 2.0 * n_params / shard[1], 12.0 * n_params / shard[2])


def object_bytes(obj: Any) -> int:
    """What a pickled object weighs on the wire (for the `dist/*_mb` metrics)."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class Heartbeat:
    """Decision "Rank heartbeats": `<directory>/rank-<r>.json`, rewritten at every phase."""

    def __init__(self, directory: str | os.PathLike, ranks: Ranks) -> None:
        self.path = Path(directory) / f"rank-{ranks.rank}.json"
        self.rank = ranks.rank
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, epoch: int, iteration: int | None, phase: str) -> None:
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "epoch": epoch,
            "iteration": iteration,
            "phase": phase,
            "time": time.time(),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)


def read_heartbeats(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(Path(directory).glob("rank-*.json")):
        try:
            record = json.loads(f.read_text())
            out[int(record["rank"])] = record
        except (ValueError, KeyError, OSError):
            continue
    return out


def where(record: dict[str, Any] | None) -> str:
    """'epoch 2 iteration 1 (update)' from a heartbeat record."""
    if not record:
        return "before its first step"
    it = record.get("iteration")
    at = f"epoch {record.get('epoch')}" + (f" iteration {it}" if it is not None else "")
    return f"{at} ({record.get('phase')})"


def launch_ranks(
    n: int, argv: Sequence[str], heartbeat_dir: str | os.PathLike, port: int, max_restarts: int = 0
) -> str | None:
    """Decision "Rank heartbeats": run `python argv...` as `n` ranks on this machine with torch's elastic
    launcher (what
    `torchrun --nproc-per-node n` runs); None when every rank succeeded, else one line naming each
    failed rank, how it ended and its last step. A rank that dies makes the launcher stop the others
    at once (no rank waits for its collective timeout)."""
    import sys
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    started = time.time()
    try:
        elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()  # the root cause; the launcher then stopped the others
        code = first.exitcode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        line = describe_failure(heartbeat_dir, {rank: how}, since=started)
        beats = {r: b for r, b in read_heartbeats(heartbeat_dir).items() if b.get("time", 0.0) >= started}
        others = [f"rank {r} (last at {where(beats.get(r))})" for r in range(n) if r != rank]
        return line + (f"; then the launcher stopped {', '.join(others)}" if others else "")
    return None


def describe_failure(directory: str | os.PathLike, failed: dict[int, str], since: float = 0.0) -> str:
    """Decision "Rank heartbeats": one line naming each failed rank (rank -> how it ended, e.g. 'signal 9')
    and its last
    step, from the heartbeats written after `since`."""
    beats = {r: b for r, b in read_heartbeats(directory).items() if b.get("time", 0.0) >= since}
    parts = [f"rank {r} {how} at {where(beats.get(r))}" for r, how in sorted(failed.items())]
    return "; ".join(parts) if parts else "no rank reported a failure"
