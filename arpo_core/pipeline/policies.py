"""What several pipeline stages share about the policy: its checkpoint (following a pretrained model's
pointer), its image processor's pixel budget and resize factor, the torch setup, and the name of the
trained method.

Decisions:
- **Pretrained pointer.** A pretrained checkpoint (e.g. UI-TARS-1.5-7B) is never copied: `init_policy` writes
  a pointer file (`pretrained.json`) and `resolve_policy` follows it.
- **Method names.** The trained policy is named by its method everywhere (`method_name`): `arpo` with
  experience replay, `grpo` without (`arpo_blind`, `grpo_blind` for the image-blind arm), so the arms of an
  ablation never share a label.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from arpo_core.config import Params

__all__ = [
    "FAMILY_PATCH_FACTORS",
    "POINTER",
    "method_name",
    "params_patch_factor",
    "patch_factor",
    "pixel_budget",
    "resolve_policy",
    "setup_torch",
]

POINTER = "pretrained.json"


def setup_torch(p: Params) -> None:
    """torch intra-op threads (`project.torch_threads`)."""
    import torch

    torch.set_num_threads(p.project.torch_threads)


def resolve_policy(path: str | os.PathLike) -> Path:
    """A checkpoint directory, following `init_policy`'s pointer file for pretrained models."""
    path = Path(path)
    pointer = path / POINTER
    if pointer.exists():
        return Path(json.loads(pointer.read_text())["path"])
    return path


def pixel_budget(policy_dir: Path) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a checkpoint's image processor without loading the model: from
    `processor_config.json` (the tiny layout) or `preprocessor_config.json` (Qwen/UI-TARS layout)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = policy_dir / name
        if f.exists():
            proc = json.loads(f.read_text())
            proc = proc.get("image_processor", proc)
            size = proc.get("size") or {}
            lo = size.get("shortest_edge", proc.get("min_pixels"))
            hi = size.get("longest_edge", proc.get("max_pixels"))
            if lo is not None and hi is not None:
                return int(lo), int(hi)
    raise FileNotFoundError(f"{policy_dir}: no image processor config with min/max pixels")


def patch_factor(policy_dir: Path) -> int:
    """The smart_resize factor (patch_size x merge_size) of a checkpoint's image processor without loading
    the model: 28 for Qwen2.5-VL, 32 for Qwen3-VL (the same files as `pixel_budget`; 14 x 2 when a
    file does not say, Qwen2-VL's image processor defaults)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = policy_dir / name
        if f.exists():
            proc = json.loads(f.read_text())
            proc = proc.get("image_processor", proc)
            return int(proc.get("patch_size", 14)) * int(proc.get("merge_size", 2))
    raise FileNotFoundError(f"{policy_dir}: no image processor config")


FAMILY_PATCH_FACTORS = {"qwen2_5_vl": 28, "qwen3_vl": 32}
"""patch_size x merge_size of each `init_policy.family` (policy/model.py, decision "Two model families")."""


def params_patch_factor(p: Params) -> int:
    """The resize factor of the policy the params describe, for a stage that has no checkpoint input
    (demos): the pretrained checkpoint's own, else the factor of the family `init_policy` builds."""
    if p.init_policy.pretrained:
        return patch_factor(Path(p.init_policy.pretrained))
    return FAMILY_PATCH_FACTORS[p.init_policy.family]


def method_name(p: Params) -> str:
    """Decision "Method names": 'arpo' with experience replay, 'grpo' without; '_blind' appended for the
    image-blind control arm (`train.image_blind`)."""
    return ("arpo" if p.train.replay.enabled else "grpo") + ("_blind" if p.train.image_blind else "")
