"""Training engines behind one small interface: plain torch (one process) and DeepSpeed (ZeRO 1/2/3).

Decisions:
- **No loss rescaling.** The update loop (update.py) only calls `backward(loss)` and `step() -> grad_norm`; it
  does its own exact micro-batch weighting, so engines never rescale the loss (DeepSpeed's `scale_wrt_gas` is
  off) and the loop marks the last backward of each mini-batch as the accumulation boundary. (DeepSpeed
  0.19.8 on CPU/gloo: ZeRO 0-2 match the torch engine exactly with accumulation; ZeRO-3 matches with
  one backward per step but NOT across several backward calls, in unmanaged mode, with explicit
  boundaries and with plain managed gradient_accumulation_steps alike (grad norm 2.71 vs 2.66 on the
  tiny policy). Until that is understood on GPUs, a ZeRO-3 engine refuses accumulation:
  `accumulates = False`, and update.py then requires micro_batch_size >= mini_batch_size.)
- **AdamW with clipping.** Optimizer: AdamW (reference: lr 1e-6, weight decay 1e-2, constant schedule) with
  grad-norm clipping (reference 1.0). Only parameters with requires_grad are optimised.
- **Checkpoint state.** State for checkpoints: `state_dict()` / `load_state_dict()` of the optimizer for the
  torch engine; the DeepSpeed engine saves its own (sharded) checkpoint directory `<epoch
  dir>/deepspeed/state/` under a fixed tag, without DeepSpeed's `latest` pointer file (the trainer's
  `checkpoints/latest` is the one pointer), and loads that tag back into a freshly built engine.
- **Lazy DeepSpeed import.** DeepSpeed is imported lazily: it is installed here (CPU, gloo backend in one
  process) but the torch engine must not pay its import time.
- **ZeRO-3 gathered save.** ZeRO-3 partitions the model's parameters in place: outside DeepSpeed's forward
  hooks each holds an empty placeholder, so `save_pretrained` (Policy.save: the trainer's checkpoint policy,
  which a resume and the final export load) would write empty tensors. The ZeRO-3 engine therefore wraps the
  model's `save_pretrained` to gather the full weights first (`full_weights()`; every rank gathers, HF
  writes). The engine checkpoint itself restores the fp32 shards and optimizer state on resume.
- **Data-parallel ranks.** (distributed.py, decision "Summed gradients"). The torch engine sums every gradient
  over the ranks before clipping (the update loop has already weighted each rank's loss by the global
  denominator, update.py, decision "Global normalisation"), like DDP but once per optimizer step. DeepSpeed
  averages gradients over its data-parallel ranks inside the boundary backward, so its engine multiplies the
  loss by R first; it needs every rank to call the backward the same number of times (`reduces_in_backward`),
  and under ZeRO-3 every forward gathers shards from all ranks (`gathers_in_forward`): the update loop keeps
  the ranks in step for both. Both engines checkpoint the number of ranks; the torch engine's optimizer state
  is whole on every rank and resumes on any number of ranks; a DeepSpeed checkpoint is sharded by rank:
  resumed on the same number it restores exactly, on another one the weights come from the checkpoint's policy
  and the optimizer starts afresh, said in one warning line.
- **Torch AdamW option.** On CUDA the DeepSpeed engine asks DeepSpeed for its own AdamW (FusedAdam), which
  DeepSpeed compiles on first use (JIT, with nvcc and ninja, a minute or more, once per machine).
  `torch_adamw=True` hands DeepSpeed torch's AdamW instead (fused on CUDA, without optimizer offload), as on
  CPU: the same update rule and the same fp32 optimizer states, no build step, for a machine where the
  build is not wanted or cannot run (benchmarks/gpu_offline.py, decision "DeepSpeed optimizer"). The
  default stays DeepSpeed's.
- **Arch list for the JIT build.** DeepSpeed 0.19.8's op builder reads `TORCH_CUDA_ARCH_LIST` as numbers and
  fails on an arch-specific entry such as `9.0a` (seen on the H200 node, which sets `9.0a`: `ValueError:
  invalid literal for int() with base 10: '0a'`, benchmarks/results/gpu.json). Before DeepSpeed
  builds FusedAdam the engine drops such suffixes (`9.0a` -> `9.0`; `+PTX` stays) and logs the change.
  FusedAdam uses no Hopper-only instruction, so nothing is lost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from arpo_core.algorithm.distributed import SINGLE, Ranks
from arpo_core.algorithm.jit_builds import load_deepspeed_ops
from arpo_core.config.sections import OptimizerConfig

_log = logging.getLogger("arpo.train")

__all__ = ["DeepSpeedEngine", "TorchEngine", "free_port", "make_engine"]


class TorchEngine:
    """AdamW + grad-norm clipping on one device; gradients summed over data-parallel ranks (decision
    "Data-parallel ranks")."""

    reduces_in_backward = False
    gathers_in_forward = False

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        ranks: Ranks = SINGLE,
    ) -> None:
        self.model = model
        self.ranks = ranks
        self.module = model
        """What forward passes go through (the model itself here; DeepSpeed's wrapper there)."""
        self.accumulates = True
        """Whether several backward calls may precede one step (gradient accumulation)."""
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        loss.backward()

    def step(self) -> float:
        self.ranks.all_reduce_grads(self.params)  # decision "Data-parallel ranks"
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if not math.isfinite(float(norm)):
            # A non-finite gradient would poison AdamW's moments: skip the step, keep the weights.
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def save(self, directory: Path) -> None:
        """Rank 0 writes the (whole, identical on every rank) optimizer state."""
        if self.ranks.main:
            torch.save(self.state_dict() | {"ranks": self.ranks.world}, directory / "engine.pt")

    def load(self, directory: Path) -> None:
        self.load_state_dict(torch.load(directory / "engine.pt", weights_only=False))


class DeepSpeedEngine:
    """DeepSpeed ZeRO engine. On CPU it runs in one process with the gloo backend (tests); on GPUs
    launch with `deepspeed --num_gpus N -m flows.cli train ...` and it shards across ranks."""

    reduces_in_backward = True

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        zero_stage: int = 2,
        bf16: bool = False,
        offload_optimizer: bool = False,
        ranks: Ranks = SINGLE,
        torch_adamw: bool = False,
    ) -> None:
        import deepspeed

        self.ranks = ranks
        self.gathers_in_forward = zero_stage == 3
        ds_adam = torch.cuda.is_available() and not torch_adamw  # DeepSpeed's AdamW, a JIT-built op
        if ds_adam:
            changed = use_ds_arch_list()  # decision "Arch list for the JIT build"
            if changed:
                _log.info("TORCH_CUDA_ARCH_LIST %r -> %r for DeepSpeed's FusedAdam build", *changed)
        # its ops built or loaded under a lock a killed builder cannot leave (jit_builds.py)
        load_deepspeed_ops(
            ("CPUAdamBuilder" if offload_optimizer else "FusedAdamBuilder") if ds_adam else None
        )
        if not torch.distributed.is_initialized():
            # a one-process group when no launcher set one up. Its rendezvous address is removed again
            # once the group exists, so a process started later (a pipeline subprocess, a benchmark)
            # does not inherit this process's MASTER_PORT, which the group's store still listens on
            # (seen: EADDRINUSE); DeepSpeed reads the rank variables later, so they stay.
            for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(k, v)
            rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            added = [k for k in rendezvous if k not in os.environ]
            os.environ.update({k: rendezvous[k] for k in added})
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            try:
                deepspeed.init_distributed(dist_backend=backend, verbose=False)
            finally:
                for k in added:
                    os.environ.pop(k, None)
        zero: dict[str, Any] = {"stage": zero_stage}
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # ZeRO 1-3 clip inside the optimizer and report the norm; at stage 0 we clip ourselves.
            "gradient_clipping": max_grad_norm if zero_stage > 0 else 0.0,
            "zero_optimization": zero,
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        if not ds_adam:
            # DeepSpeed's fused/CPU-Adam kernels need a JIT build; torch's AdamW runs anywhere
            # (decision "Torch AdamW option").
            config.pop("optimizer")
            fused = {"fused": True} if torch.cuda.is_available() and not offload_optimizer else {}
            optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, **fused
            )
        else:
            optimizer = None
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=None if optimizer else model.parameters(),
            config=config,
        )
        self.model = model
        self.module = self.engine  # ZeRO-3 gathers partitioned weights in the wrapper's forward hooks
        self.zero_stage = zero_stage
        self.accumulates = zero_stage < 3  # decision "No loss rescaling"
        self.max_grad_norm = max_grad_norm
        if zero_stage == 3 and callable(getattr(model, "save_pretrained", None)):
            _gather_on_save_pretrained(model)  # decision "ZeRO-3 gathered save"

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """Within the block the model's parameters hold their full (read-only) values: a no-op below ZeRO-3;
        under ZeRO-3 the shards are gathered on every rank and released afterwards (changes are dropped)."""
        if self.zero_stage < 3:
            yield
            return
        with _gathered(self.model):
            yield

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        # Our update loop weights micro-batches itself (update.py, decision "Exact micro-batching"), and tells
        # us which backward closes the mini-batch: DeepSpeed reduces (ZeRO-2/3: reduce-scatters) gradients
        # there.
        self.engine.set_gradient_accumulation_boundary(boundary)
        # DeepSpeed averages over its data-parallel ranks; the loop's losses are shares of a sum
        self.engine.backward(loss * self.ranks.world, scale_wrt_gas=False)

    def step(self) -> float:
        if self.zero_stage == 0:
            params = [p for p in self.model.parameters() if p.requires_grad]
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
            self.engine.step()
            return norm
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    CHECKPOINT_TAG = "state"
    """DeepSpeed's tag (sub-directory) of the engine checkpoint inside `<epoch dir>/deepspeed`.
    Decision "Checkpoint state": one fixed tag and no DeepSpeed `latest` pointer file - the trainer's own
    `checkpoints/latest` names the epoch. (A tag named "latest" collided with that pointer file:
    IsADirectoryError, issue 16.)"""

    def save(self, directory: Path) -> None:
        """Every rank writes its shards (a collective: all ranks call it, on a shared filesystem)."""
        self.engine.save_checkpoint(
            str(Path(directory) / "deepspeed"), tag=self.CHECKPOINT_TAG, save_latest=False
        )
        if self.ranks.main:
            (Path(directory) / "deepspeed" / "ranks.json").write_text(json.dumps({"ranks": self.ranks.world}))

    def load(self, directory: Path) -> None:
        """Restores the module weights and the (sharded) optimizer state saved by `save`. Must be called on
        a freshly built engine (DeepSpeed: a ZeRO-3 engine cannot reload into already-trained partitions)."""
        path = Path(directory) / "deepspeed"
        if not (path / self.CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"no DeepSpeed engine checkpoint at {path / self.CHECKPOINT_TAG}")
        saved = (
            json.loads((path / "ranks.json").read_text())["ranks"] if (path / "ranks.json").exists() else 1
        )
        if (
            saved != self.ranks.world
        ):  # decision "Data-parallel ranks": the weights come from the checkpoint's policy
            _log.warning(
                "the DeepSpeed optimizer state in %s was sharded over %d rank(s), this run has %d: the "
                "weights resume from the checkpoint's policy, the optimizer state starts afresh",
                path,
                saved,
                self.ranks.world,
            )
            return
        load_path, _ = self.engine.load_checkpoint(
            str(path), tag=self.CHECKPOINT_TAG, load_module_strict=True, load_optimizer_states=True
        )
        if load_path is None:  # DeepSpeed only logs a warning when it finds nothing to load
            raise RuntimeError(f"DeepSpeed could not load the engine checkpoint at {path}")


@contextlib.contextmanager
def _gathered(model: torch.nn.Module) -> Iterator[None]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield


def _gather_on_save_pretrained(model: torch.nn.Module) -> None:
    """Decision "ZeRO-3 gathered save": the model's own `save_pretrained` (Policy.save: checkpoints, exports)
    gathers its ZeRO-3 shards first, so it writes the full weights instead of the empty local placeholders."""
    save = model.save_pretrained

    @functools.wraps(save)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        with _gathered(model):
            return save(*args, **kwargs)

    model.save_pretrained = save_pretrained


def ds_arch_list(value: str) -> str:
    """`TORCH_CUDA_ARCH_LIST` as DeepSpeed's op builder can parse it: arch-specific suffixes dropped
    (`"8.0;9.0a"` -> `"8.0;9.0"`, `"9.0a+PTX"` -> `"9.0+PTX"`), duplicates once; decision "Arch list for the
    JIT build"."""
    out: list[str] = []
    for entry in re.split(r"[;\s]+", value.strip()):
        entry = re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", entry)
        if entry and entry not in out:
            out.append(entry)
    return ";".join(out)


def use_ds_arch_list() -> tuple[str, str] | None:
    """Set `TORCH_CUDA_ARCH_LIST` to what DeepSpeed's op builder can parse (`ds_arch_list`) before a JIT
    build; returns (as it was, as it is now) when that changed it, else None."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not arch or ds_arch_list(arch) == arch:
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = ds_arch_list(arch)
    return arch, os.environ["TORCH_CUDA_ARCH_LIST"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(name: str, model: torch.nn.Module, optimizer: OptimizerConfig, **kwargs: Any):
    """'torch' or 'deepspeed' with a section's optimizer settings (lr, weight decay, clip, bf16); other kwargs
    go to the engine (zero_stage, ranks, ...)."""
    kwargs |= {
        "lr": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "max_grad_norm": optimizer.max_grad_norm,
        "bf16": optimizer.bf16,
    }
    if name == "torch":
        kwargs.pop("zero_stage", None)
        kwargs.pop("bf16", None)
        kwargs.pop("offload_optimizer", None)
        kwargs.pop("torch_adamw", None)
        return TorchEngine(model, **kwargs)
    if name == "deepspeed":
        return DeepSpeedEngine(model, **kwargs)
    raise ValueError(f"unknown engine {name!r}; choose 'torch' or 'deepspeed'")
