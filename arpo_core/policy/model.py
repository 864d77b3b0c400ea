"""The policy: a Qwen2.5-VL or Qwen3-VL model with its tokenizer and image processor, loaded from any
checkpoint directory (UI-TARS-1.5-7B's layout, a Qwen3-VL / GUI-Owl-1.5 checkpoint in the Hub's sharded
layout) or built offline as a tiny model of either architecture.

Decisions:
- **One loader.** One loader for every checkpoint. `load_policy` never goes through `AutoProcessor`: without
  torchvision the stock `Qwen2_5_VLProcessor` cannot be built (its video processor needs torchvision) and
  `AutoProcessor` silently returns the bare tokenizer (docs/method.md §6). Instead it assembles
  `PolicyProcessor` (a `Qwen2_5_VLProcessor` without a video processor) from `AutoTokenizer` and
  `Qwen2VLImageProcessorPil`, which read `tokenizer.json` and `preprocessor_config.json` of any
  Qwen2.5-VL checkpoint, stock or tiny.
- **Offline tiny model.** The tiny model is built fully offline: a byte-level BPE trained locally with
  `tokenizers` on a corpus generated here (both system prompts, the UI-TARS reply grammar, MiniWoB-style
  instructions, numbers), with Qwen's pre-tokeniser, so digits are single tokens and a coordinate is a digit
  sequence exactly as in Qwen/UI-TARS. Qwen's special tokens are appended after the BPE vocabulary, so the
  chat markup (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`, ...) is identical to
  UI-TARS's.
- **Model sizes.** Sizes trade CPU time for capacity (docs/method.md §6: the vocabulary dominates the cost, so
  it stays <= 8k). Parameter counts with the default corpus (whose BPE stops at 1,014 merges + 14 specials =
  1,028 tokens) and tied embeddings: `xs` 741,632 (text h128 x 2 layers, vision h64 x 1),
  `s` 5,074,816 (h256 x 4, vision h128 x 2), `m` 36,508,928 (h512 x 8, vision h256 x 4);
  `tests/test_policy_model.py` pins them.
- **M-RoPE sections.** `mrope_section` is derived from the head size (it must sum to head_dim / 2) in the
  1:1.5:1.5 ratio of Qwen2.5-VL's [16, 24, 24] for head_dim 128.
- **Pixel budget.** The image processor's pixel budget is `size={"shortest_edge": min_pixels, "longest_edge":
  max_pixels}` (the min/max_pixels call kwargs are deprecated). The tiny default keeps MiniWoB's 160x210
  screen at its natural scale (168x224 after smart_resize, 48 visual tokens).
- **Tied embeddings.** Embeddings are tied for the tiny sizes (the vocabulary is most of a 1M-parameter
  model); UI-TARS-7B is untied, which `load_policy` simply reads from its config.
- **Linear patch embedding.** The vision patch embedding is a Conv3d whose kernel equals its stride and its
  input: one matrix product per patch. `Policy` computes it as that product (`LinearPatchEmbed`, the same
  weight, the same state dict; vLLM does the same for Qwen2.5-VL): on a CPU torch's conv3d is ~20x slower for
  it (7 ms of a 50 ms prefill of 8 MiniWoB screenshots with the xs policy). A weight partitioned by DeepSpeed
  ZeRO-3 (`ds_id`) takes the stock path, whose module hooks gather it.
- **Array image inputs.** Screenshots become pixel patches through `image_inputs`: the stock
  `Qwen2VLImageProcessorPil`'s exact steps (smart_resize, PIL bicubic resize, rescale in float64, normalise in
  float32, patchify with the temporal copy) written as a few array operations, without the stock call's
  validation and format round trips, and the normalisation is a per-channel table lookup (1.9 ms -> 0.8 ms per
  160x210 screenshot, most of it PIL's bicubic resize; every prompt of every
  step re-encodes its screenshots). `tests/test_policy_model.py` checks it equals the stock processor,
  bit for bit, over sizes that are and are not resized; a processor configured otherwise (no resize,
  no rescale, another class) takes the stock call.
- **Two model families.** Two model families (`FAMILIES`, docs/models.md): `qwen2_5_vl` (Qwen2.5-VL, UI-
  TARS-1.5) and `qwen3_vl` (Qwen3-VL, GUI-Owl-1.5), told apart by config.json's `model_type`; anything else is
  one `InputError` line naming the type and the supported ones. Both use the same image processor class
  (`Qwen2VLImageProcessorPil`, which reads patch 14 / mean CLIP for Qwen2.5-VL and patch 16 / mean 0.5 for
  Qwen3-VL from the checkpoint), the same tokenizer markup and the same `get_rope_index` / `mm_token_type_ids`
  interface, so everything above this module sees one `Policy`. The processor is the family's stock processor
  class without its video processor (`PolicyProcessor`, `Qwen3PolicyProcessor`: both need torchvision for
  video only). Qwen3-VL's patch embedding has a bias, so its linear form (decision "Linear patch embedding") adds it.
- **Tiny Qwen3-VL.** The tiny Qwen3-VL is built from a stock `Qwen3VLConfig` with the same tokenizer recipe
  (its corpus holds the tool-call replies of its grammar, and `<tool_call>` / `</tool_call>` are added tokens
  that survive `skip_special_tokens`, as in Qwen's own tokenizer), patch 16 x merge 2 (a visual token is 32x32
  model-image pixels), the interleaved M-RoPE split of Qwen3-VL (`mrope_section_qwen3`, [24, 20, 20] for
  head_dim 128), a learned 16x16 position grid and one DeepStack merger. It is saved like a Hub checkpoint
  when asked (`max_shard_size`: `model-0000k-of-0000N.safetensors` and `model.safetensors.index.json`), which
  `load_policy` reads like any other.
- **Gradient checkpointing.** `Policy.set_gradient_checkpointing(True)` turns on transformers' activation
  checkpointing for every decoder and vision block (non-reentrant: it works with DeepSpeed ZeRO-3's
  gather hooks and with inputs that need no grad): a training forward keeps only each block's input and
  the backward recomputes the rest, so the activations of a 15-screenshot 1080p trajectory (~40k tokens)
  fit beside a 7B model's optimizer states. The same gradients (tests/test_gpu_offline.py), about one
  more forward of compute. It applies in train mode only; generation (eval mode) is unchanged. Off by
  default: params `train.gradient_checkpointing` (the paper preset turns it on; benchmarks/gpu_offline.py too).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from torch.nn import functional as F
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

from arpo_core.actions import Action, format_tool_call_response
from arpo_core.infra.errors import InputError
from arpo_core.infra.fileio import check_space, file_problem, write_error
from arpo_core.policy.prompt import SYSTEM_PROMPTS, system_turns

__all__ = [
    "FAMILIES",
    "QWEN_SPECIAL_TOKENS",
    "SIZES",
    "TINY_SHARD_SIZE",
    "TOOL_CALL_TOKENS",
    "Policy",
    "PolicyProcessor",
    "Qwen3PolicyProcessor",
    "TinySize",
    "build_tiny_policy",
    "checkpoint_family",
    "count_parameters",
    "default_corpus",
    "grow_depth",
    "grow_vision_depth",
    "image_inputs",
    "load_policy",
    "mrope_section",
    "mrope_section_qwen3",
    "resplit_mrope",
    "tiny_config",
    "tiny_image_processor",
    "train_tokenizer",
]

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""Decision "Two model families": the model families, by config.json `model_type`."""

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2.5-VL's special tokens in their original order (ids 151643.. in Qwen; appended after BPE here)."""

TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
"""Added, not special, tokens of Qwen's tokenizers (151657, 151658 there): a decoded reply keeps them with
`skip_special_tokens`. The tiny Qwen3-VL has them (decision "Tiny Qwen3-VL")."""

TINY_SHARD_SIZE = "1MB"
"""Shard size of the tiny Qwen3-VL as `init_policy` saves it: several shards, as on the Hub (decision "Tiny Qwen3-VL")."""

# Qwen2's pre-tokeniser regex: `\p{N}` alone makes every digit its own pre-token, hence its own token.
_QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 448 * 448
"""Tiny model's pixel budget: MiniWoB's 160x210 is kept at scale; larger screens are scaled down."""


class PolicyProcessor(Qwen2_5_VLProcessor):
    """`Qwen2_5_VLProcessor` without a video processor (which needs torchvision; docs/method.md §6).

    Behaves like the stock processor for images and text and saves/loads with `save_pretrained` /
    `from_pretrained`.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen3PolicyProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without a video processor (decision "Two model families"), like `PolicyProcessor`."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class LinearPatchEmbed(Qwen2_5_VisionPatchEmbed):
    """Qwen2.5-VL's patch embedding as the matrix product it is (decision "Linear patch embedding")."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight  # (embed_dim, C, T, P, P)
        if hasattr(w, "ds_id"):  # ZeRO-3 partitioned: the stock forward's module hooks gather it
            return super().forward(hidden_states)
        return F.linear(hidden_states.to(w.dtype).reshape(-1, w[0].numel()), w.reshape(w.shape[0], -1))


class Qwen3LinearPatchEmbed(Qwen3VLVisionPatchEmbed):
    """Qwen3-VL's patch embedding (a Conv3d with a bias) as the matrix product it is (decisions "Linear patch embedding" and "Two model families")."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w, b = self.proj.weight, self.proj.bias
        if hasattr(w, "ds_id"):
            return super().forward(hidden_states)
        x = hidden_states.to(w.dtype).reshape(-1, w[0].numel())
        return F.linear(x, w.reshape(w.shape[0], -1), b)


_LINEAR_PATCH_EMBEDS = {
    Qwen2_5_VisionPatchEmbed: LinearPatchEmbed,
    Qwen3VLVisionPatchEmbed: Qwen3LinearPatchEmbed,
}


def use_linear_patch_embed(model: torch.nn.Module) -> None:
    """Switch every stock patch embedding of `model` to its linear form (in place, same parameters)."""
    for m in model.modules():
        linear = _LINEAR_PATCH_EMBEDS.get(type(m))
        if linear is not None:
            m.__class__ = linear


_MODEL_CLASSES = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}
_PROCESSOR_CLASSES = {"qwen2_5_vl": PolicyProcessor, "qwen3_vl": Qwen3PolicyProcessor}
_FAMILY_NAMES = {"qwen2_5_vl": "Qwen2.5-VL, e.g. UI-TARS-1.5", "qwen3_vl": "Qwen3-VL, e.g. GUI-Owl-1.5"}


def checkpoint_family(path: str | Path) -> str:
    """The family (`FAMILIES`) of the checkpoint at `path`, from config.json's `model_type` (decision "Two model families").
    Raises InputError with one line naming an unsupported type and the supported ones."""
    path = Path(path)
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise InputError(f"cannot load the policy at {path}: config.json is unreadable ({e})") from None
    if model_type not in _MODEL_CLASSES:
        supported = ", ".join(f"{k} ({v})" for k, v in _FAMILY_NAMES.items())
        raise InputError(
            f"cannot load the policy at {path}: model_type {model_type!r} is not supported; supported: "
            f"{supported}"
        )
    return str(model_type)


def _missing_shards(path: Path) -> str | None:
    """The Hub's sharded layout: every file the index names must be there (a partial download)."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return None
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return f"{index.name} is unreadable ({e})"
    missing = [f for f in files if not (path / f).exists()]
    if missing:
        return f"{index.name} names {len(files)} shard(s), {len(missing)} missing: {', '.join(missing[:3])}"
    return None


def _fast_path_ok(proc) -> bool:
    """The processor settings `image_inputs` reproduces (decision "Array image inputs"); anything else takes
    the stock call."""
    return (
        isinstance(proc, Qwen2VLImageProcessorPil)
        and type(proc).resize is Qwen2VLImageProcessorPil.resize
        and type(proc)._preprocess is Qwen2VLImageProcessorPil._preprocess
        and bool(proc.do_resize and proc.do_rescale and proc.do_normalize and proc.do_convert_rgb)
        and bool(proc.size.get("shortest_edge") and proc.size.get("longest_edge"))
    )


def image_inputs(
    proc: Qwen2VLImageProcessorPil, images: Sequence[Image.Image]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`proc(images=images, return_tensors="pt")`'s (pixel_values (P, C*T*p*p), image_grid_thw (N, 3)),
    computed directly (decision "Array image inputs")."""
    if not _fast_path_ok(proc):
        out = proc(images=[im.convert("RGB") for im in images], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]
    p, m, t = int(proc.patch_size), int(proc.merge_size), int(proc.temporal_patch_size)
    # Every uint8 value's normalised float, per channel, by the stock arithmetic (rescale in float64,
    # then (x - mean) / std in float32): a table lookup gives the same numbers as the per-pixel math.
    mean = np.asarray(proc.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(proc.image_std, dtype=np.float32)[:, None]
    values = (np.arange(256, dtype=np.float64) * proc.rescale_factor).astype(np.float32)
    table = (values[None, :] - mean) / std  # (C, 256)
    patches, grids = [], []
    for im in images:
        im = im.convert("RGB")
        h, w = hf_smart_resize(
            im.height,
            im.width,
            factor=p * m,
            min_pixels=proc.size["shortest_edge"],
            max_pixels=proc.size["longest_edge"],
        )
        if (w, h) != im.size:
            im = im.resize((w, h), resample=proc.resample)
        gh, gw = h // p, w // p
        # (H, W, C) -> (gh/m, gw/m, m, m, C, p, p): the stock patch order, still uint8
        x = np.asarray(im).reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        out = np.empty((gh // m, gw // m, m, m, 3, t, p, p), dtype=np.float32)
        for c in range(3):
            np.take(table[c], x[:, :, :, :, c], out=out[:, :, :, :, c, 0])
        out[:, :, :, :, :, 1:] = out[:, :, :, :, :, :1]  # the temporal copies of a still image
        patches.append(out.reshape(gh * gw, 3 * t * p * p))
        grids.append((1, gh, gw))
    pixels = np.concatenate(patches, axis=0) if len(patches) > 1 else patches[0]
    return torch.from_numpy(pixels), torch.tensor(grids, dtype=torch.long)


@dataclass
class Policy:
    """A loaded policy: model, processor and tokenizer plus the token ids the rest of the code needs."""

    model: Qwen2_5_VLForConditionalGeneration | Qwen3VLForConditionalGeneration
    processor: PolicyProcessor | Qwen3PolicyProcessor
    tokenizer: Qwen2Tokenizer

    _text_ids: dict[str, tuple[int, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)
    image_blind: bool = field(default=False, compare=False)
    """The image-blind control arm (params `train.image_blind`): every screenshot this policy is shown -
    in generation and in every training or log-prob forward - is replaced by a blank one of the same
    size (`model_images`), so what it learns is what the instructions and its own replies alone buy."""

    def __post_init__(self) -> None:
        use_linear_patch_embed(self.model)  # decision "Linear patch embedding"

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Decision "Gradient checkpointing". (transformers 5.24 renamed `gradient_checkpointing_*` to
        `activation_checkpointing_*` and deprecated the old names; either is used, whichever exists.)"""
        m = self.model
        if enabled:
            kwargs = {"use_reentrant": False}
            if hasattr(m, "activation_checkpointing_enable"):
                m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif hasattr(m, "activation_checkpointing_disable"):
            m.activation_checkpointing_disable()
        else:
            m.gradient_checkpointing_disable()

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether any block of the model checkpoints its activations (decision "Gradient checkpointing")."""
        return any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules())

    def model_images(self, images: Sequence[Image.Image]) -> list[Image.Image]:
        """The images the model sees for `images`: themselves, or blank white ones of the same sizes
        when `image_blind`."""
        if not self.image_blind:
            return list(images)
        return [Image.new("RGB", im.size, (255, 255, 255)) for im in images]

    def text_ids(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, remembered: the prompt's fixed segments
        (system prompt, instruction, chat markup) recur in every step of every episode."""
        ids = self._text_ids.get(text)
        if ids is None:
            if len(self._text_ids) >= 4096:  # replies in the history vary: bound the memory
                self._text_ids.clear()
            ids = self._text_ids[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return list(ids)

    @property
    def family(self) -> str:
        """`qwen2_5_vl` or `qwen3_vl` (decision "Two model families")."""
        return str(self.model.config.model_type)

    @property
    def image_processor(self) -> Qwen2VLImageProcessorPil:
        return self.processor.image_processor

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def im_start_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_start|>")

    @property
    def im_end_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    @cached_property
    def vision_token_ids(self) -> list[int]:
        """Ids of the vision special tokens (`<|vision_start|>`, `<|image_pad|>`, ...) this tokenizer has;
        a reply must never contain one (generate.py, decision "Vision tokens banned")."""
        vocab = self.tokenizer.get_vocab()
        names = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
        return sorted(vocab[n] for n in names if n in vocab)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.convert_tokens_to_ids("<|endoftext|>"))

    @property
    def min_pixels(self) -> int:
        return int(self.image_processor.size["shortest_edge"])

    @property
    def max_pixels(self) -> int:
        return int(self.image_processor.size["longest_edge"])

    @property
    def patch_factor(self) -> int:
        """Side of one visual token in model-image pixels: the smart_resize factor of the model image
        (Qwen2.5-VL: patch 14 x merge 2 = 28; Qwen3-VL: 16 x 2 = 32)."""
        return int(self.image_processor.patch_size * self.image_processor.merge_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def save(self, out_dir: str | Path, max_shard_size: int | str | None = None) -> Path:
        """save_pretrained of model and processor (tokenizer + image processor) into one directory. The
        weights' size is checked against the free space first, and a full disk or an unwritable
        directory is one `OutputError` saying what, where and how much (fileio.py,
        decision "Clear output errors"), not safetensors' "Error while serializing". `max_shard_size` (e.g.
        "1MB"): the Hub's sharded layout (decision "Tiny Qwen3-VL"); None: one weights file unless
        transformers' default shard size is exceeded."""
        out_dir = Path(out_dir)
        tensors = [*self.model.parameters(), *self.model.buffers()]  # parameters(): tied weights once
        needed = sum(t.numel() * t.element_size() for t in tensors)
        check_space(out_dir, needed, "policy")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            self.model.save_pretrained(out_dir, **kwargs)
            self.processor.save_pretrained(out_dir)
        except Exception as e:
            err = write_error(e, "policy", out_dir, needed=needed or None)
            if err is None:
                raise
            raise err from e
        return out_dir


def load_policy(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Policy:
    """Load any Qwen2.5-VL or Qwen3-VL checkpoint directory (UI-TARS-1.5-7B, GUI-Owl-1.5, one written by
    `build_tiny_policy`), one weights file or the Hub's shards (decision "Two model families").

    `min_pixels` / `max_pixels` override the checkpoint's pixel budget (the ARPO reference runs
    UI-TARS-1.5 with max_pixels 2,116,800, below its stock 12,845,056; docs/method.md §2). The model is put
    in eval mode; callers that train switch it to train mode themselves.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no Qwen2.5-VL / Qwen3-VL checkpoint at {path} (config.json missing)")
    family = checkpoint_family(path)
    for f in sorted(path.glob("*.safetensors")):  # a truncated copy: one line naming it, and no retry
        problem = file_problem(f)
        if problem is not None:
            raise InputError(f"cannot load the policy at {path}: {problem}")
    if (problem := _missing_shards(path)) is not None:
        raise InputError(f"cannot load the policy at {path}: {problem}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Passed as min/max_pixels, which Qwen2VLImageProcessorPil applies after the stored `size` (or the
    # stock config's own min/max_pixels keys), so the override wins in both layouts.
    budget = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, **budget)
    processor = _PROCESSOR_CLASSES[family](image_processor=image_processor, tokenizer=tokenizer)
    model = _MODEL_CLASSES[family].from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    return Policy(model=model, processor=processor, tokenizer=tokenizer)


def grow_depth(policy: Policy, after: Sequence[int], seed: int = 0) -> Policy:
    """A deeper copy of `policy`'s language model that computes exactly the same function at first.

    One new decoder layer is inserted after each old layer index in `after` (e.g. `[0, 1]` turns
    layers (a, b) into (a, new, b, new)). A new layer is freshly initialised except its attention output
    and MLP down projections, which are zero, so it adds nothing to the residual stream until trained
    (the same trick as LoRA's zero B). The vision tower, embeddings, head and generation config are
    copied unchanged. The result is a stock checkpoint of the same family with a larger
    `num_hidden_layers`: used to give a trained tiny model more depth without losing what it learned.
    Qwen3-VL adds its DeepStack visual features after the first decoder layers by index, so there a new
    layer may only follow the last of them (or a later layer): anything else would move them.
    """
    old = policy.model
    n_old = old.config.text_config.num_hidden_layers
    if not after or any(not 0 <= i < n_old for i in after):
        raise ValueError(f"`after` must name layers in [0, {n_old}), got {list(after)}")
    deepstack = len(getattr(old.config.vision_config, "deepstack_visual_indexes", None) or ())
    if deepstack and min(after) < deepstack - 1:
        raise ValueError(
            f"`after` must name layers >= {deepstack - 1} for this Qwen3-VL model: its {deepstack} DeepStack "
            f"feature(s) enter after decoder layers 0..{deepstack - 1}, got {list(after)}"
        )
    config = old.config.__class__.from_dict(old.config.to_dict())
    n_new = n_old + len(after)
    config.text_config.num_hidden_layers = n_new
    if getattr(config.text_config, "layer_types", None) is not None:
        config.text_config.layer_types = [config.text_config.layer_types[0]] * n_new
    torch.manual_seed(seed)  # the new layers' initialisation
    model = type(old)(config)
    order = _grown_order(n_old, after)
    state = _insert_layers(old.state_dict(), model.state_dict(), LM_LAYERS, order, _ZERO_LM_OUTPUTS)
    return _rebuild(policy, model, state)


LM_LAYERS = "model.language_model.layers."
"""The name prefix of a decoder layer's parameters (both families), before its index."""
VISION_BLOCKS = "model.visual.blocks."
"""The name prefix of a vision block's parameters (both families), before its index."""

_ZERO_LM_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
"""A new decoder layer's parameters that write to the residual stream (no biases in either family)."""

_ZERO_VISION_OUTPUTS = (
    "attn.proj.weight",
    "attn.proj.bias",
    "mlp.down_proj.weight",  # Qwen2.5-VL's gated MLP
    "mlp.down_proj.bias",
    "mlp.linear_fc2.weight",  # Qwen3-VL's
    "mlp.linear_fc2.bias",
)
"""A new vision block's parameters that write to its residual stream."""


def _grown_order(n_old: int, after: Sequence[int]) -> list[int | None]:
    """New position -> old index (None = a new layer), one new layer after each index in `after`."""
    order: list[int | None] = []
    for i in range(n_old):
        order.append(i)
        order += [None] * list(after).count(i)
    return order


def _insert_layers(
    state: Mapping[str, torch.Tensor],
    new_state: dict[str, torch.Tensor],
    prefix: str,
    order: Sequence[int | None],
    zero: Sequence[str],
) -> dict[str, torch.Tensor]:
    """`new_state` (a fresh build's) with every weight copied from `state` but for the layers under `prefix`
    that `order` marks new: those keep their fresh initialisation, with the parameters named in `zero`
    zeroed, so each adds nothing to the residual stream until trained."""
    for key in new_state:
        if key.startswith(prefix):
            idx, rest = key[len(prefix) :].split(".", 1)
            src = order[int(idx)]
            if src is not None:
                new_state[key] = state[f"{prefix}{src}.{rest}"].clone()
            elif rest in zero:
                new_state[key] = torch.zeros_like(new_state[key])
        else:
            new_state[key] = state[key].clone()
    return new_state


def grow_vision_depth(policy: Policy, after: Sequence[int], seed: int = 0) -> Policy:
    """A copy of `policy` whose vision tower has more blocks and computes exactly the same function at first.

    As `grow_depth` for the tower: one new block after each old block index in `after`, freshly initialised
    but for its attention output and MLP output projections (weights and biases), which are zero, so it
    adds nothing to the tower's residual stream until trained. A new block attends as the block before it
    does (Qwen2.5-VL's `fullatt_block_indexes`, full or windowed), and the old blocks keep their kind and,
    in Qwen3-VL, their DeepStack taps (`deepstack_visual_indexes`, renumbered): the language model gets
    the same tokens. A stock checkpoint of the same family with a larger vision `depth`: used to give a
    trained tiny tower more depth, e.g. to build words out of glyphs spread over several patches.
    """
    old = policy.model
    vision = old.config.vision_config
    n_old = vision.depth
    if not after or any(not 0 <= i < n_old for i in after):
        raise ValueError(f"`after` must name vision blocks in [0, {n_old}), got {list(after)}")
    order = _grown_order(n_old, after)
    where = {src: pos for pos, src in enumerate(order) if src is not None}  # old index -> new position
    config = old.config.__class__.from_dict(old.config.to_dict())
    config.vision_config.depth = len(order)
    if getattr(vision, "fullatt_block_indexes", None) is not None:
        full, last = set(vision.fullatt_block_indexes), None
        kinds = []
        for src in order:
            last = src if src is not None else last
            kinds.append(last in full)
        config.vision_config.fullatt_block_indexes = [i for i, f in enumerate(kinds) if f]
    if getattr(vision, "deepstack_visual_indexes", None):
        config.vision_config.deepstack_visual_indexes = [where[i] for i in vision.deepstack_visual_indexes]
    torch.manual_seed(seed)  # the new blocks' initialisation
    model = type(old)(config)
    state = _insert_layers(old.state_dict(), model.state_dict(), VISION_BLOCKS, order, _ZERO_VISION_OUTPUTS)
    return _rebuild(policy, model, state)


def widen_vision(policy: Policy, hidden: int, seed: int = 0) -> Policy:
    """A copy of `policy` whose Qwen2.5-VL vision tower is `hidden` channels wide and gives the language model
    the same tokens at first (up to float rounding: its norms' epsilon).

    The new channels are more attention heads of the same head size (so the tower's rotary bands stay) and
    a wider MLP and merger, by the same ratio: everything that reads a new channel, head or MLP unit is
    freshly initialised, everything that writes into one is zero (the patch embedding's new filters, the
    attention and MLP output projections' new rows, and their columns from the new heads and units, the
    merger's columns from its new units), so the residual stream's new channels start at zero and a new
    head or unit adds nothing until trained, as `grow_vision_depth`'s new blocks. The RMS norms then divide
    by a root mean square over more channels, so their old weights are scaled by sqrt(old / new) to give the
    same outputs. A stock checkpoint of the same family with a larger vision `hidden_size`, `num_heads` and
    `intermediate_size`: used to give a trained tiny tower room for words spread over several patches.
    Qwen3-VL's tower normalises with LayerNorm, whose mean a zero channel moves: refused.
    """
    old = policy.model
    vision = old.config.vision_config
    if old.config.model_type != "qwen2_5_vl":
        raise ValueError(
            f"widen_vision: only Qwen2.5-VL towers (RMS norms) widen keeping their function; this is "
            f"{old.config.model_type!r}, whose LayerNorm a zero channel moves"
        )
    h0, i0 = vision.hidden_size, vision.intermediate_size
    head = h0 // vision.num_heads
    if hidden <= h0 or hidden % head or (i0 * hidden) % h0:
        raise ValueError(
            f"widen_vision: `hidden` must exceed the tower's {h0} channels in whole heads of {head} (and widen "
            f"its MLP's {i0} units by a whole number), got {hidden}"
        )
    i1 = i0 * hidden // h0
    config = old.config.__class__.from_dict(old.config.to_dict())
    config.vision_config.hidden_size = hidden
    config.vision_config.num_heads = hidden // head
    config.vision_config.intermediate_size = i1
    torch.manual_seed(seed)  # the new channels' readers
    model = type(old)(config)
    new, was = model.state_dict(), old.state_dict()
    norm = (h0 / hidden) ** 0.5
    merge = config.vision_config.spatial_merge_size**2
    for key in new:
        if not key.startswith("model.visual."):
            new[key] = was[key].clone()
            continue
        w, o = new[key], was[key]
        rest = key[len("model.visual.") :].split(".")
        name = ".".join(rest[2:] if rest[0] == "blocks" else rest)
        if name == "patch_embed.proj.weight":  # writes the stream: new filters zero
            w.zero_()
            w[:h0] = o
        elif name in ("norm1.weight", "norm2.weight", "merger.ln_q.weight"):
            w[:h0] = o * norm
        elif name in ("attn.qkv.weight", "attn.qkv.bias"):  # reads: old heads copied, new ones fresh
            for part in range(3):  # q, k, v, each head-major
                if w.dim() == 2:
                    w[part * hidden : part * hidden + h0, :h0] = o[part * h0 : (part + 1) * h0]
                else:
                    w[part * hidden : part * hidden + h0] = o[part * h0 : (part + 1) * h0]
        elif name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            w[:i0, :h0] = o
        elif name in ("mlp.gate_proj.bias", "mlp.up_proj.bias", "merger.mlp.0.bias"):
            w[: o.shape[0]] = o
        elif name in ("attn.proj.weight", "mlp.down_proj.weight", "attn.proj.bias", "mlp.down_proj.bias"):
            w.zero_()  # writes the stream: new rows, and columns from new heads and units, zero
            if w.dim() == 2:
                w[:h0, : o.shape[1]] = o
            else:
                w[:h0] = o
        elif name == "merger.mlp.0.weight":  # its input is `merge` tokens' channels side by side
            for j in range(merge):
                w[: merge * h0, j * hidden : j * hidden + h0] = o[:, j * h0 : (j + 1) * h0]
        elif name == "merger.mlp.2.weight":
            w.zero_()
            w[:, : merge * h0] = o
        elif name == "merger.mlp.2.bias":
            w.copy_(o)
        else:
            raise ValueError(f"widen_vision: no rule for the tower's parameter {key!r}")
    return _rebuild(policy, model, new)


def grown_prefixes(policy: Policy, after: Sequence[int] = (), vision_after: Sequence[int] = ()) -> list[str]:
    """The parameter-name prefixes of the decoder layers that `grow_depth(..., after)` and of the vision
    blocks that `grow_vision_depth(..., vision_after)` added to `policy` (the policy they returned): e.g.
    `["model.language_model.layers.1."]` for `after=[0]` on a 2-layer model. Used to give them a
    learning rate of their own (a ground phase's `grown_lr_scale`)."""
    config = policy.model.config
    parts = (
        (LM_LAYERS, config.text_config.num_hidden_layers, after),
        (VISION_BLOCKS, config.vision_config.depth, vision_after),
    )
    prefixes = []
    for prefix, depth, added in parts:
        if added:
            order = _grown_order(depth - len(added), added)
            prefixes += [f"{prefix}{pos}." for pos, src in enumerate(order) if src is None]
    return prefixes


def output_norms(policy: Policy) -> dict[str, float]:
    """The Frobenius norm of every decoder layer's and vision block's weights that write to their residual
    stream (those a grown layer starts with at zero), keyed `layers.<i>.<name>` and `blocks.<i>.<name>`:
    how far a grown layer has engaged, beside the trained ones (a ground phase that grows reports them)."""
    norms = {}
    for name, p in policy.model.named_parameters():
        for prefix, short, outputs in (
            (LM_LAYERS, "layers.", _ZERO_LM_OUTPUTS),
            (VISION_BLOCKS, "blocks.", _ZERO_VISION_OUTPUTS),
        ):
            rest = name[len(prefix) :].split(".", 1)
            if name.startswith(prefix) and rest[1] in outputs and rest[1].endswith("weight"):
                norms[f"{short}{name[len(prefix) :]}"] = round(float(p.detach().float().norm()), 2)
    return norms


def resplit_mrope(policy: Policy, section: Sequence[int]) -> Policy:
    """A copy of `policy` whose language model splits its rotary frequencies over (t, h, w) as `section`
    (config `rope_parameters.mrope_section`; the weights unchanged, a stock checkpoint of the same family).

    The split decides what the weights compute: a frequency moved from the h band to the t band stops
    rotating with an image token's row, so a trained model has to relearn what read that frequency. Used to
    put a lever on a trained model (benchmarks/grounding_lab.py `--init ... --mrope`), e.g. a wider t band,
    whose frequencies turn by the same angle for every image token seen from a later token.
    """
    old = policy.model
    text = old.config.text_config
    family = old.config.model_type
    _check_mrope(section, text.hidden_size // text.num_attention_heads, family)
    config = old.config.__class__.from_dict(old.config.to_dict())
    config.text_config.rope_parameters = {**text.rope_parameters, "mrope_section": list(section)}
    return _rebuild(policy, type(old)(config), old.state_dict())


def _rebuild(policy: Policy, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Policy:
    """`model` (a new build of `policy`'s model class) with the weights `state`, in `policy`'s dtype and
    device, in eval mode, with its generation config (stop tokens etc.), processor and tokenizer."""
    old = policy.model
    model.to(old.dtype)
    model.load_state_dict(state)
    model.generation_config = copy.deepcopy(old.generation_config)
    model.to(old.device).eval()
    return Policy(model=model, processor=policy.processor, tokenizer=policy.tokenizer)


# ----------------------------------------------------------------------------------------------------
# The tiny offline model


@dataclass(frozen=True)
class TinySize:
    """Architecture of one tiny size."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vocab: int
    """Target BPE vocabulary (before the special tokens); the trainer may stop earlier on a small corpus."""


SIZES: dict[str, TinySize] = {
    "xs": TinySize(128, 2, 4, 2, 384, 64, 1, 2, 2048),
    "s": TinySize(256, 4, 4, 2, 1024, 128, 2, 2, 2048),
    "m": TinySize(512, 8, 8, 4, 2048, 256, 4, 4, 4096),
}


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies over (t, h, w) like Qwen2.5-VL's [16, 24, 24] for 128.

    >>> mrope_section(128), mrope_section(32)
    ([16, 24, 24], [4, 6, 6])
    """
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def mrope_section_qwen3(head_dim: int) -> list[int]:
    """Qwen3-VL's (t, h, w) split of head_dim / 2 rotary frequencies, [24, 20, 20] for 128, scaled.

    Qwen3-VL interleaves the axes (frequency i is h when i % 3 == 1 and i < 3h, w when i % 3 == 2 and
    i < 3w, t otherwise), so h and w can be at most a third of the frequencies each.

    >>> mrope_section_qwen3(128), mrope_section_qwen3(32)
    ([24, 20, 20], [6, 5, 5])
    """
    half = head_dim // 2
    h = half * 20 // 64
    return [half - 2 * h, h, h]


def _check_mrope(section: Sequence[int], head_dim: int, family: str) -> None:
    half = head_dim // 2
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope must be 3 numbers summing to head_dim / 2 = {half}, got {list(section)}")
    if family == "qwen3_vl":  # interleaved: h at 1, 4, 7, ... < 3h and w at 2, 5, 8, ... < 3w
        h_max, w_max = len(range(1, half, 3)), len(range(2, half, 3))
        if section[1] > h_max or section[2] > w_max:
            raise ValueError(
                f"mrope {list(section)}: Qwen3-VL interleaves the axes, so h <= {h_max} and w <= {w_max} "
                f"for head_dim {head_dim} (e.g. {mrope_section_qwen3(head_dim)})"
            )


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


_TASK_TEMPLATES = (
    "Click the button.",
    "Click on the {w} button.",
    'Click the button labelled "{W}".',
    "Click on the link {w}.",
    'Click on the "{w}" link.',
    "Click the {c} square.",
    "Click on the {s}.",
    "Click on the tab #{n}.",
    "Select {w} from the list and click Submit.",
    "Select {w}, {w2} and click Submit.",
    "Focus into the text field.",
    "Focus into the {o} input field.",
    "Enter {w} into the text field and press Submit.",
    'Type "{w}" into the textbox and press Submit.',
    "Enter the username {w} and the password {w2} into the text fields and press login.",
    "Expand the section and click on the {w} link.",
    "Close the dialog box by clicking the x.",
    "Click OK in the dialog box.",
    "Click on the {c} colored box.",
    "Check the {w} checkbox and press Submit.",
    "Click button ONE, then click button TWO.",
    "Drag the {w} item to the top of the list.",
    "Scroll down and click the {w} link.",
    "Find the email by {W} and reply to them.",
    "Open the file {w}.txt and save it.",
    "Enter the date {n}/{n2}/20{n}{n2} and submit.",
    "Search for {w} and select the first result.",
)
_WORDS = (
    "submit ok cancel yes no next previous previous home about contact login search save open close "
    "apple banana cherry delta echo golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu alpha bravo charlie foxtrot red green "
    "blue yellow orange purple black white gray pink brown circle square triangle rectangle star "
    "first second third fourth fifth left right up down top bottom middle center"
).split()
_COLORS = ("red", "green", "blue", "yellow", "orange", "purple", "black", "white", "gray", "pink")
_SHAPES = ("circle", "square", "triangle", "rectangle", "star", "digit", "letter")
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "last")
_THOUGHTS = (
    "I need to click the {w} button to finish the task.",
    "The {w} link is visible near the top, so I will click it.",
    "The text field is empty. I will click it first and then type the text.",
    "The task asks me to select {w}; I can see it in the list.",
    "Everything is done, so I will submit.",
    "I can see the {c} square in the middle of the screen.",
    "The dialog is open. I will close it with the x in its corner.",
    "The page has not loaded yet, so I will wait.",
    "I should scroll down to find the {w} link.",
    "The task is complete.",
)


def _action_samples(rng: random.Random) -> list[str]:
    def pt() -> str:
        return f"({rng.randint(0, 1999)},{rng.randint(0, 1999)})"

    w = rng.choice(_WORDS)
    return [
        f"click(start_box='{pt()}')",
        f"left_double(start_box='{pt()}')",
        f"right_single(start_box='{pt()}')",
        f"hover(start_box='{pt()}')",
        f"drag(start_box='{pt()}', end_box='{pt()}')",
        f"hotkey(key='ctrl {rng.choice('acvxzs')}')",
        f"press(key='{rng.choice(['enter', 'tab', 'space', 'backspace', 'escape', 'down', 'up'])}')",
        "keydown(key='shift')",
        "keyup(key='shift')",
        f"type(content='{w}')",
        f"type(content='{w}\\n')",
        f"scroll(start_box='{pt()}', direction='{rng.choice(['up', 'down', 'left', 'right'])}')",
        "wait()",
        f"finished(content='{w}')",
        "call_user()",
        f"click(start_box='<|box_start|>{pt()}<|box_end|>')",
    ]


def _tool_call_samples(rng: random.Random) -> list[Action]:
    """One action of every kind the tool-call grammar writes, 0-1000 coordinates (decision "Tiny Qwen3-VL")."""

    def pt() -> tuple[float, float]:
        return (float(rng.randint(0, 1000)), float(rng.randint(0, 1000)))

    w = rng.choice(_WORDS)
    return [
        Action("click", point=pt()),
        Action("left_double", point=pt()),
        Action("right_single", point=pt()),
        Action("hover", point=pt()),
        Action("drag", point=pt(), end_point=pt()),
        Action("hotkey", key=f"ctrl {rng.choice('acvxzs')}"),
        Action("press", key=rng.choice(["enter", "tab", "space", "backspace", "escape", "down", "up"])),
        Action("type", content=w),
        Action("type", content=f"{w}\n"),
        Action("scroll", point=pt(), direction=rng.choice(["up", "down", "left", "right"])),
        Action("wait"),
        Action("finished", content=w),
        Action("finished"),
        Action("call_user"),
    ]


def default_corpus(n: int = 4000, seed: int = 0, family: str = "qwen2_5_vl") -> list[str]:
    """A tokenizer-training corpus: the family's prompts, MiniWoB-style instructions and replies in the
    family's grammar (`qwen2_5_vl`: the UI-TARS and compact prompts, UI-TARS replies; `qwen3_vl`: every
    prompt with its system turns, Qwen3-VL tool-call replies).

    Deterministic in `seed`. Replies mix every action kind with random coordinates so that the BPE
    learns the grammar's punctuation (`(start_box='(`, `{"name": "computer_use", "arguments": {"action":`)
    as a few tokens. The `qwen2_5_vl` corpus is the one the versioned tiny checkpoints were built from.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    rng = random.Random(seed)
    if family == "qwen2_5_vl":
        lines: list[str] = [SYSTEM_PROMPTS[k].format(instruction="") for k in ("uitars", "compact")]
        lines.append("You are a helpful assistant.")
    else:
        lines = [*system_turns(), "You are a helpful assistant."]
    for _ in range(n):
        fill = {
            "w": rng.choice(_WORDS),
            "w2": rng.choice(_WORDS),
            "W": rng.choice(_WORDS).capitalize(),
            "c": rng.choice(_COLORS),
            "s": rng.choice(_SHAPES),
            "o": rng.choice(_ORDINALS),
            "n": rng.randint(1, 9),
            "n2": rng.randint(0, 9),
        }
        lines.append(rng.choice(_TASK_TEMPLATES).format(**fill))
        thought = rng.choice(_THOUGHTS).format(**fill)
        if family == "qwen2_5_vl":
            action = rng.choice(_action_samples(rng))
            lines.append(f"Thought: {thought}\nAction: {action}")
        else:
            lines.append(format_tool_call_response(thought, [rng.choice(_tool_call_samples(rng))]))
    return lines


def train_tokenizer(
    corpus: Iterable[str], vocab_size: int, added_tokens: Sequence[str] = ()
) -> Qwen2Tokenizer:
    """Train a byte-level BPE with Qwen2's normaliser/pre-tokeniser and wrap it as a `Qwen2Tokenizer`.

    Qwen's special tokens are appended after the learned vocabulary; `<|im_end|>` is the end of a turn
    (eos) and `<|endoftext|>` pads, as in Qwen2.5-VL-Instruct. `added_tokens` (e.g. `TOOL_CALL_TOKENS`)
    follow them as added, not special, tokens: never split, kept by `skip_special_tokens`.
    """
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    model_json = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model_json["vocab"]
    for t in QWEN_SPECIAL_TOKENS:  # fixed ids in Qwen's order, right after the learned vocabulary
        vocab[t] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    wrapped = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS),
        model_max_length=32768,
    )
    missing = [
        t for t in QWEN_SPECIAL_TOKENS if wrapped.convert_tokens_to_ids(t) in (None, wrapped.unk_token_id)
    ]
    if missing:
        raise RuntimeError(f"special tokens not registered: {missing}")
    if added_tokens:
        wrapped.add_tokens(list(added_tokens))
    return wrapped


def tiny_config(
    size: TinySize,
    tokenizer: Qwen2Tokenizer,
    rope_theta: float = 1e6,
    mrope: Sequence[int] | None = None,
    family: str = "qwen2_5_vl",
) -> Qwen2_5_VLConfig | Qwen3VLConfig:
    """Config of one tiny size in `family` (`FAMILIES`), its token ids taken from `tokenizer`.

    `rope_theta` / `mrope` (the (t, h, w) split of head_dim / 2 frequencies; default `mrope_section`, or
    `mrope_section_qwen3` for Qwen3-VL) override the LM's rotary settings. Qwen2.5-VL gives the (t, h, w)
    sections contiguous frequency bands, highest first, so with theta 1e6 the w band of a 64-wide head
    turns < 2e-4 rad per image token: no usable horizontal resolution in a 6-token-wide image
    (arpo_core/offline/grounding.py, decision "Rotary frequencies"). Qwen3-VL interleaves them
    (decision "Tiny Qwen3-VL").
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    head_dim = size.hidden // size.heads
    default = mrope_section(head_dim) if family == "qwen2_5_vl" else mrope_section_qwen3(head_dim)
    section = list(mrope) if mrope is not None else default
    _check_mrope(section, head_dim, family)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    rope = {"rope_type": "default", "rope_theta": float(rope_theta), "mrope_section": section}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "max_position_embeddings": 32768,
        "rope_parameters": rope,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": True,
    }
    tokens = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    if family == "qwen3_vl":
        text["head_dim"] = head_dim  # Qwen3-VL's text config defaults it to 128
        rope["mrope_interleaved"] = True  # what Qwen3-VL checkpoints write (the model always interleaves)
        vision = {
            "depth": size.vision_depth,
            "hidden_size": size.vision_hidden,
            "intermediate_size": 2 * size.vision_hidden,
            "num_heads": size.vision_heads,
            "out_hidden_size": size.hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 256,  # a learned 16x16 grid, resampled to each image (48x48 stock)
            # one DeepStack merger, after the first vision block (stock: blocks 8, 16, 24 of 27)
            "deepstack_visual_indexes": [0],
        }
        return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=True)
    vision = {
        "depth": size.vision_depth,
        "hidden_size": size.vision_hidden,
        "intermediate_size": 2 * size.vision_hidden,
        "num_heads": size.vision_heads,
        "out_hidden_size": size.hidden,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        # The last block attends over the whole image, the others within 4x4-token windows (as in 7B).
        "fullatt_block_indexes": [size.vision_depth - 1],
    }
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=True)


def tiny_image_processor(family: str, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    """The family's image processor with the given pixel budget: Qwen2.5-VL's stock settings (patch 14,
    CLIP mean/std) or Qwen3-VL's (patch 16, mean/std 0.5; its preprocessor_config.json)."""
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    if family == "qwen3_vl":
        return Qwen2VLImageProcessorPil(
            size=size,
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        )
    return Qwen2VLImageProcessorPil(size=size)


def build_tiny_policy(
    out_dir: str | Path,
    size: str | TinySize = "xs",
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    rope_theta: float = 1e6,
    mrope: Sequence[int] | None = None,
    family: str = "qwen2_5_vl",
    max_shard_size: int | str | None = None,
) -> Policy:
    """Build a randomly initialised tiny policy of `family` (`FAMILIES`) offline, save it to `out_dir`,
    return it.

    `size` is a name of `SIZES` or a `TinySize` (e.g. a grounding experiment's wider vision tower). The
    directory is a normal checkpoint (`load_policy(out_dir)` gives the same model). `corpus` trains
    the tokenizer; default `default_corpus(seed=seed, family=family)`. `rope_theta` / `mrope` set the LM's
    rotary frequencies (see `tiny_config`; both are plain config values, so any loader reads them).
    `max_shard_size` (e.g. `TINY_SHARD_SIZE`): save in the Hub's sharded layout (decision "Tiny Qwen3-VL").
    """
    if not isinstance(size, TinySize) and size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {sorted(SIZES)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    arch = size if isinstance(size, TinySize) else SIZES[size]
    corpus = default_corpus(seed=seed, family=family) if corpus is None else corpus
    tokenizer = train_tokenizer(corpus, arch.vocab, TOOL_CALL_TOKENS if family == "qwen3_vl" else ())
    image_processor = tiny_image_processor(family, min_pixels, max_pixels)
    processor = _PROCESSOR_CLASSES[family](image_processor=image_processor, tokenizer=tokenizer)
    config = tiny_config(arch, tokenizer, rope_theta=rope_theta, mrope=mrope, family=family)
    # Weight init draws from torch's global RNG: seed it inside fork_rng so the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _MODEL_CLASSES[family](config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.eval()
    policy = Policy(model=model, processor=processor, tokenizer=tokenizer)
    policy.save(out_dir, max_shard_size=max_shard_size)
    return policy
