"""GPU benchmark for one H200-class GPU: vLLM generation throughput and a DeepSpeed ZeRO training step of a
Qwen2.5-VL model at 7B shape with random weights (issue 9, item 6). UNTESTED ON A GPU: written and
CPU-tested (config, parameter count, argument parsing, results file, the DeepSpeed step at a tiny
shape) on a machine without one.

    # 1. on any machine with the CPU env (.venv): write the model dir (config + tokenizer + processor)
    .venv/bin/python benchmarks/gpu_bench.py --prepare-only --model-dir /tmp/qwen7b-shape
    # 2. on the GPU machine, in the vLLM env (scripts/setup_gpu.sh): all parts, < 8 minutes
    .venv-gpu/bin/python benchmarks/gpu_bench.py --model-dir /tmp/qwen7b-shape --out gpu_bench.json
    # CPU check of everything but vLLM (tiny shape, fp32, gloo):
    .venv/bin/python benchmarks/gpu_bench.py --tiny --parts config,zero2,zero3 --out /tmp/gpu_tiny.json

Decisions:
- **Qwen2.5-VL-7B shape.** Shape from Qwen2.5-VL-7B-Instruct's published config.json (hidden 3584, 28 layers,
  28 heads, 4 KV heads, intermediate 18944, vocab 152064, untied embeddings; vision depth 32, hidden 1280, 16
  heads, intermediate 3420, window 112, full attention at blocks 7/15/23/31), written in the transformers-4
  config format (`rope_scaling: {type: mrope}`) that vLLM's pinned transformers reads and transformers 5
  still accepts. About 8.3B parameters (checked on the meta device, no allocation).
- **Tiny tokenizer ids.** Token ids come from the project's tiny tokenizer (its Qwen special tokens), which
  stands in for the 152k Qwen tokenizer: no download. The vocab stays 152064, so sampled ids can exceed the
  tokenizer's vocabulary; vLLM therefore runs with `detokenize=False` and `ignore_eos=True` (every request
  yields exactly `--gen-tokens` tokens: comparable numbers).
- **Dummy vLLM weights.** vLLM loads with `load_format='dummy'` (random weights, no checkpoint). Pixel budget
  is the ARPO reference's (min 3136, max 2,116,800 pixels: a 1920x1080 screenshot becomes 1932x1092 = 2691
  image tokens; a 160x210 MiniWoB screen 168x224 = 48 tokens).
- **DeepSpeed training step.** Training step: `deepspeed.initialize` directly with torch's AdamW (fused on
  CUDA), bf16, gradient checkpointing, one sample of one screenshot + `--train-text-tokens` text tokens,
  labels on the text. Not `arpo_core/algorithm/engines.py`: on CUDA it asks DeepSpeed for its own AdamW
  (FusedAdam), which is JIT-compiled and needs nvcc, unknown on the target box. The optimizer states are the
  same size. Memory note: on ONE GPU ZeRO shards nothing; full fine-tuning keeps bf16 weights + bf16 grads +
  fp32 master + two fp32 Adam moments = 16 bytes/param = ~124 GiB at 8.3B, so the full model is close to an
  H200's 141 GB; `--freeze-vision` (LM only, ~7.6B) leaves more headroom. An out-of-memory error is
  recorded as a result, not a crash.
- **Subprocess parts.** Every GPU part runs in its own subprocess with a time limit (vLLM keeps its memory
  until the process ends; a crash or a hang in one part does not lose the others) and writes a partial JSON
  that the parent merges into `--out`. Default limits sum to < 8 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
MIN_PIXELS = 3136
"""ARPO reference pixel budget (docs/method.md §2)."""
MAX_PIXELS = 2_116_800
SIZES = {"miniwob": (160, 210), "1080p": (1920, 1080)}
"""Screenshot sizes (width, height) of the generation benchmark."""
PART_TIMEOUT_S = {"vllm": 240, "zero2": 100, "zero3": 100}
"""Per-part limits (decision "Subprocess parts"): sum 440 s plus process starts, under 8 minutes."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    fullatt_blocks: tuple[int, ...]
    mrope_section: tuple[int, int, int]
    """(t, h, w) rotary frequency split; sums to head_dim / 2."""


QWEN25VL_7B = Shape(
    hidden=3584,
    layers=28,
    heads=28,
    kv_heads=4,
    intermediate=18944,
    vocab=152064,
    vision_depth=32,
    vision_hidden=1280,
    vision_heads=16,
    vision_intermediate=3420,
    fullatt_blocks=(7, 15, 23, 31),
    mrope_section=(16, 24, 24),
)
"""Qwen2.5-VL-7B-Instruct's published dimensions (decision "Qwen2.5-VL-7B shape")."""

TINY = Shape(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=2048,
    vision_depth=2,
    vision_hidden=32,
    vision_heads=2,
    vision_intermediate=64,
    fullatt_blocks=(1,),
    mrope_section=(2, 3, 3),
)
"""CPU test shape with the same structure."""

TOKEN_KEYS = {
    "bos_token_id": "<|endoftext|>",
    "eos_token_id": "<|im_end|>",
    "pad_token_id": "<|endoftext|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
"""Config key -> special token whose id the config must carry."""

QWEN_7B_TOKEN_IDS = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
}
"""The published config's ids (used when no tokenizer is given, e.g. for counting parameters)."""


def qwen25vl_config(shape: Shape, token_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """config.json of a Qwen2.5-VL model of `shape` (decision "Qwen2.5-VL-7B shape"); `token_ids` maps
    TOKEN_KEYS to ids."""
    if 2 * sum(shape.mrope_section) != shape.hidden // shape.heads:
        raise ValueError(
            f"mrope_section {shape.mrope_section} must sum to head_dim/2 = {shape.hidden // shape.heads // 2}"
        )
    ids = dict(QWEN_7B_TOKEN_IDS if token_ids is None else token_ids)
    if set(ids) != set(TOKEN_KEYS):
        raise ValueError(f"token_ids must have exactly the keys {sorted(TOKEN_KEYS)}")
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "attention_dropout": 0.0,
        **ids,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": 128000,
        "max_window_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(shape.mrope_section)},
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": shape.vocab,
        "vision_config": {
            "depth": shape.vision_depth,
            "hidden_act": "silu",
            "hidden_size": shape.vision_hidden,
            "intermediate_size": shape.vision_intermediate,
            "num_heads": shape.vision_heads,
            "in_chans": 3,
            "out_hidden_size": shape.hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": list(shape.fullatt_blocks),
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    }


def hf_config(config: dict[str, Any]):
    """The installed transformers' Qwen2_5_VLConfig of a config.json dict."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig.from_dict(dict(config))


def count_params(config: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of the model `config` describes, built on the meta device (no memory)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(hf_config(config))
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in _visual(model).parameters())
    return {"total": total, "vision": vision, "language": total - vision}


def _visual(model):
    """The vision tower (`model.model.visual` in recent transformers, `model.visual` in older ones)."""
    inner = getattr(model, "model", None)
    return inner.visual if inner is not None and hasattr(inner, "visual") else model.visual


def image_tokens(width: int, height: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """LM tokens of one image after smart_resize (28-px grid) and the 2x2 merge."""
    from arpo_core.actions import smart_resize

    h, w = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // 28) * (w // 28)


def prepare_model_dir(model_dir: Path, shape: Shape) -> dict[str, Any]:
    """Write config.json, generation_config.json, tokenizer and processor files
    (decision "Tiny tokenizer ids") in the stock Qwen2.5-VL formats, no weights. Needs the CPU env (the
    project's tokenizer trainer)."""
    try:
        from arpo_core.policy.model import SIZES as TINY_SIZES
        from arpo_core.policy.model import default_corpus, train_tokenizer
    except ImportError as e:  # e.g. vLLM's older transformers in .venv-gpu
        raise SystemExit(
            f"cannot build the tokenizer here ({e}); write the model dir with the CPU env first: "
            f".venv/bin/python benchmarks/gpu_bench.py --prepare-only --model-dir {model_dir}"
        ) from e

    model_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(default_corpus(), TINY_SIZES["xs"].vocab)
    ids = {k: int(tok.convert_tokens_to_ids(t)) for k, t in TOKEN_KEYS.items()}
    if len(tok) > shape.vocab:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than the shape's vocab {shape.vocab}")
    config = qwen25vl_config(shape, ids)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        (model_dir / "tokenizer.json").write_bytes((Path(tmp) / "tokenizer.json").read_bytes())
    files = {
        "config.json": config,
        "generation_config.json": {
            "bos_token_id": ids["bos_token_id"],
            "eos_token_id": [ids["eos_token_id"]],
            "pad_token_id": ids["pad_token_id"],
        },
        "tokenizer_config.json": {
            "tokenizer_class": "Qwen2TokenizerFast",
            "model_max_length": 131072,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
        },
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "rescale_factor": 1 / 255,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },
    }
    for name, obj in files.items():
        (model_dir / name).write_text(json.dumps(obj, indent=2) + "\n")
    return config


# ---------------------------------------------------------------------------------------- training part
def make_train_batch(config: dict[str, Any], width: int, height: int, text_tokens: int, seed: int = 0):
    """One sample: [vision_start, image_pad x N, vision_end, text...] with random pixels and text ids,
    labels on the text only. Built without a processor: pixel_values is (patches, 3*2*14*14) with
    patches = (h/14)*(w/14) of the 28-aligned size, image_grid_thw = [[1, h/14, w/14]].

    Returns a dict of CPU tensors: input_ids/labels/attention_mask (1, T), pixel_values
    (patches, 1176), image_grid_thw (1, 3)."""
    import torch

    from arpo_core.actions import smart_resize

    g = torch.Generator().manual_seed(seed)
    h, w = smart_resize(height, width, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    gh, gw = h // 14, w // 14
    n_img = gh * gw // 4
    # Text ids stay below every special id (the tiny tokenizer appends them last; Qwen's sit at 151643+).
    text = torch.randint(0, min(config[k] for k in TOKEN_KEYS), (text_tokens,), generator=g)
    ids = torch.cat(
        [
            torch.tensor([config["vision_start_token_id"]]),
            torch.full((n_img,), config["image_token_id"]),
            torch.tensor([config["vision_end_token_id"]]),
            text,
        ]
    )[None]
    labels = ids.clone()
    labels[:, : n_img + 2] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(gh * gw, 3 * 2 * 14 * 14, generator=g),
        "image_grid_thw": torch.tensor([[1, gh, gw]]),
    }


def _init_distributed() -> None:
    import deepspeed
    import torch

    if torch.distributed.is_initialized():
        return
    from arpo_core.algorithm.engines import free_port
    from arpo_core.algorithm.jit_builds import load_deepspeed_ops

    for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    load_deepspeed_ops()  # built under a lock a killed builder cannot leave (arpo_core/algorithm/jit_builds.py)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)


def train_step_bench(
    config: dict[str, Any],
    zero_stage: int,
    *,
    image: tuple[int, int] = SIZES["1080p"],
    text_tokens: int = 256,
    steps: int = 3,
    freeze_vision: bool = False,
    device: str = "cuda",
) -> dict[str, Any]:
    """Median step time (forward + backward + optimizer step) and peak memory of a DeepSpeed ZeRO step
    (decision "DeepSpeed training step"). bf16 on CUDA, fp32 on CPU (gloo, for tests). The first step is a
    warm-up."""
    import deepspeed
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    cuda = device.startswith("cuda")
    _init_distributed()
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    with torch.device(device):
        # Built in the default dtype and cast: the dtype keyword of _from_config differs between
        # transformers 4 (torch_dtype) and 5 (dtype). The fp32 transient is before the memory reset.
        model = Qwen2_5_VLForConditionalGeneration._from_config(hf_config(config)).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if freeze_vision:
        _visual(model).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)  # before ZeRO-3 partitions them (numel 0 after)
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=1e-2, **({"fused": True} if cuda else {}))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": cuda},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    init_s = time.perf_counter() - t0
    batch = make_train_batch(config, *image, text_tokens)
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["pixel_values"] = batch["pixel_values"].to(dtype)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    timed = times[1:] or times
    out = {
        "zero_stage": zero_stage,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "trainable_params": n_trainable,
        "freeze_vision": freeze_vision,
        "seq_len": int(batch["input_ids"].shape[1]),
        "image": list(image),
        "init_s": round(init_s, 2),
        "step_s_median": round(statistics.median(timed), 4),
        "step_s_runs": [round(t, 4) for t in times],
        "tokens_per_s": round(batch["input_ids"].shape[1] / statistics.median(timed), 1),
        "losses": [round(v, 4) for v in losses],
    }
    if cuda:
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
    return out


# ---------------------------------------------------------------------------------------- vLLM part
def user_prompt(i: int) -> str:
    """Raw Qwen chat prompt with one image placeholder (vLLM's processor expands `<|image_pad|>`)."""
    return (
        "<|im_start|>system\nYou are a GUI agent.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|image_pad|><|vision_end|>Click the button number {i}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def screenshot(width: int, height: int, i: int):
    """A distinct image per request (no multi-modal prefix-cache hits across requests)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    x, y = (37 * i) % max(1, width - 40), (53 * i) % max(1, height - 20)
    d.rectangle((x, y, x + 40, y + 20), fill=(200, 30 + i % 200, 30))
    return img


def vllm_bench(
    model_dir: Path, batches: dict[str, int], gen_tokens: int, enforce_eager: bool
) -> dict[str, Any]:
    """Generation throughput of batched one-image requests per screenshot size (decisions "Tiny tokenizer ids"
    and "Dummy vLLM weights")."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=8192,
        limit_mm_per_prompt={"image": 1},
        mm_processor_kwargs={"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS},
        gpu_memory_utilization=0.85,
        enforce_eager=enforce_eager,
        seed=0,
    )
    out: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 1), "gen_tokens": gen_tokens}
    params = SamplingParams(temperature=1.0, max_tokens=gen_tokens, ignore_eos=True, detokenize=False, seed=0)
    for name, batch in batches.items():
        w, h = SIZES[name]
        reqs = [
            {"prompt": user_prompt(i), "multi_modal_data": {"image": screenshot(w, h, i)}}
            for i in range(batch)
        ]
        llm.generate(reqs[:2], params, use_tqdm=False)  # warm-up (image processor, kernels at this size)
        t0 = time.perf_counter()
        res = llm.generate(reqs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        gen = sum(len(r.outputs[0].token_ids) for r in res)
        prompt = sum(len(r.prompt_token_ids) for r in res)
        out[name] = {
            "batch": batch,
            "image": [w, h],
            "prompt_tokens_per_request": prompt / batch,
            "wall_s": round(wall, 3),
            "gen_tokens_per_s": round(gen / wall, 1),
            "total_tokens_per_s": round((gen + prompt) / wall, 1),
            "requests_per_s": round(batch / wall, 2),
        }
    return out


# ---------------------------------------------------------------------------------------- driver
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="config,vllm,zero2,zero3", help="comma-separated subset")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/arpo-gpu-bench/qwen25vl-7b-shape"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_bench.json"))
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU (tests); vllm part skipped")
    ap.add_argument("--prepare-only", action="store_true", help="write the model dir and exit")
    ap.add_argument("--batch-miniwob", type=int, default=64)
    ap.add_argument("--batch-1080p", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    ap.add_argument("--train-image", default="1080p", choices=sorted(SIZES))
    ap.add_argument("--train-text-tokens", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=3, help="incl. one warm-up step")
    ap.add_argument("--freeze-vision", action="store_true")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # child process: run one part
    ap.add_argument("--part-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    for p in args.parts:
        if p not in ("config", "vllm", "zero2", "zero3"):
            ap.error(f"unknown part {p!r} (choose from config, vllm, zero2, zero3)")
    if args.tiny and "vllm" in args.parts:
        args.parts.remove("vllm")
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    return TINY if args.tiny else QWEN25VL_7B


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    """One GPU part in this process (the child side of decision "Subprocess parts")."""
    config = json.loads((args.model_dir / "config.json").read_text())
    if part == "vllm":
        batches = {"miniwob": args.batch_miniwob, "1080p": args.batch_1080p}
        return vllm_bench(args.model_dir, batches, args.gen_tokens, args.enforce_eager)
    import torch

    if args.tiny:
        torch.set_num_threads(1)  # CPU run on a shared machine: more threads spin (params.yaml)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    image = (56, 56) if args.tiny else SIZES[args.train_image]
    try:
        return train_step_bench(
            config,
            int(part.removeprefix("zero")),
            image=image,
            text_tokens=16 if args.tiny else args.train_text_tokens,
            steps=args.train_steps,
            freeze_vision=args.freeze_vision,
            device=device,
        )
    except torch.OutOfMemoryError as e:
        return {"zero_stage": int(part.removeprefix("zero")), "oom": True, "error": str(e)[:500]}


def run_child(cmd: Sequence[str], timeout_s: float, merge_output: bool) -> tuple[int | None, str]:
    """Run `cmd` from the project root in its own process group, killed as a group when it ends, when it runs
    past `timeout_s` and when this process is stopped (vLLM starts engine processes of its own, which must
    not outlive a part: they would hold GPU memory through the next one). Returns (exit code, or None when
    timed out; its stderr, or stdout and stderr interleaved with `merge_output`)."""
    stderr = subprocess.STDOUT if merge_output else subprocess.PIPE
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return code, (out if merge_output else err) or ""


def spawn_part(part: str, args: argparse.Namespace, argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run `part` in a child process with a time limit; its JSON, or what went wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        part_out = Path(tmp) / "part.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
            "--part",
            part,
            "--part-out",
            str(part_out),
        ]
        t0 = time.perf_counter()
        code, stderr = run_child(cmd, timeout_s, merge_output=False)
        if code is None:
            return {"error": f"timed out after {timeout_s} s", "stderr_tail": stderr[-3000:]}
        wall = round(time.perf_counter() - t0, 1)
        if code != 0 or not part_out.exists():
            return {"error": f"exit {code}", "stderr_tail": stderr[-3000:], "wall_s": wall}
        res = json.loads(part_out.read_text())
        res["wall_s"] = wall
        return res


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["gpu_mem_gib"] = round(p.total_memory / GIB, 1)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("vllm", "deepspeed", "transformers"):
        try:
            info[mod] = version(mod)  # no import: vLLM's takes seconds
        except PackageNotFoundError:
            info[mod] = None
    return info


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from arpo_core.infra.fileio import atomic_write_json as write_json  # stdlib only: fine in .venv-gpu

    if args.part is not None:  # child
        write_json(args.part_out, run_part(args.part, args))
        return {}
    shape = shape_of(args)
    if args.prepare_only or not (args.model_dir / "tokenizer.json").exists():
        prepare_model_dir(args.model_dir, shape)
        if args.prepare_only:
            print(f"wrote {args.model_dir}")
            return {}
    config = json.loads((args.model_dir / "config.json").read_text())
    if config["hidden_size"] != shape.hidden:
        raise SystemExit(
            f"{args.model_dir} holds another shape (hidden {config['hidden_size']}); use a new --model-dir"
        )
    record: dict[str, Any] = {
        "benchmark": "gpu_bench",
        "command": "python benchmarks/gpu_bench.py " + " ".join(argv),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "shape": "tiny" if args.tiny else "qwen2.5-vl-7b",
        "results": {},
    }
    for part in args.parts:
        if part == "config":
            n = count_params(config)
            record["results"]["config"] = {
                "params": n,
                "params_b": round(n["total"] / 1e9, 3),
                # decision "DeepSpeed training step"
                "full_finetune_state_gib": round(16 * n["total"] / GIB, 1),
                "image_tokens": {k: image_tokens(*v) for k, v in SIZES.items()},
            }
        else:
            timeout = PART_TIMEOUT_S[part] * (3 if args.tiny else 1)
            record["results"][part] = spawn_part(part, args, argv, timeout)
        print(part, json.dumps(record["results"][part])[:400], flush=True)
        write_json(args.out, record)  # after every part: a later hang keeps the earlier results
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
