"""The offline GPU check (issue 31 item 6): on one GPU with no network (the H200 node lent to this project:
its own torch 2.11 and transformers 5.17, no vLLM, no DeepSpeed, no browser, at most 64 MiB brought along),
the project's OWN code at Qwen2.5-VL-7B shape with random weights: `HFGenerator` throughput at batch 8, 32
and 128 with a 1920x1080 screenshot per prompt, and one `ppo_update` step through the project's engines
(DeepSpeed ZeRO-3, ZeRO-2, the torch engine) on a trajectory of 1 and of 15 such screenshots, with time
and peak GPU memory; everything into one JSON file. Run once on one H200 (2026-12-04,
benchmarks/results/gpu.json, docs/scale-out.md "Measured on one H200"); its dry run (the same functions at a
tiny shape on CPU) is tested in tests/test_gpu_offline.py; docs/scale-out.md, "Offline GPU check".

    # here, where PyPI is reachable: the carry folder .gpu-offline/ (wheels the node lacks)
    bash scripts/gpu_check_prepare.sh
    # there, in the repository root with .gpu-offline carried: < 8 minutes
    bash scripts/gpu_check_offline.sh                 # -> benchmarks/results/gpu.json
    # here, on CPU: the dry run (tiny shape, the same code paths)
    bash scripts/gpu_check_offline.sh --dry-run

Decisions:
- **Project code paths.** Generation is `HFGenerator.generate` (generate.py: prompt encoding, the shared
  prompt head, the lean decoder, per-row seeds); the update is `encode_trajectories` + `ppo_update`
  (update.py) with `make_engine` (engines.py) and a `TrainConfig`; the policy is a `Policy` with the
  project's `PolicyProcessor` and tiny tokenizer (model.py). Nothing here re-implements a step; the
  only instrumentation is timing hooks (decision "Where the time goes").
- **Random 7B weights.** The model is gpu_bench.py's Qwen2.5-VL-7B config (gpu_bench.py, decisions
  "Qwen2.5-VL-7B shape" and "Tiny tokenizer ids": 8.29B parameters, vocab 152064, the tiny tokenizer's
  special-token ids) built directly on the GPU from the config, in bf16 for generation and DeepSpeed
  (which trains a bf16 module), in fp32 for the torch engine (the trainer loads fp32 and autocasts).
  No checkpoint, no download.
- **Synthetic screenshots.** Screenshots are 1920x1080 PIL drawings made on the spot (a few boxes and
  lines, distinct per prompt); at the reference pixel budget (min 3136, max 2,116,800 pixels, docs/method.md
  §2) each is 2691 image tokens, counted from the encoded sequence and recorded.
- **Exact reply length.** The generator used is `HFGenerator` with the stop ids banned as well as the vision
  ids (its `banned_ids` hook, as benchmarks/bench_generation.py does): every row draws exactly
  `gen_tokens` tokens, so tokens/s compare across batch sizes. Sampling at temperature 1, one seed per row.
- **Where the time goes.** A generate call's wall time is split by forward hooks (CUDA-synchronised) on the
  vision tower and the language model, and by a timing wrapper around generate.py's `encode_prompt` (the
  CPU side: image resize and patches): encode, vision, LM forward (the prefill; with the lean decoder
  the decode steps bypass it) and the rest (decode steps). The vision tower of transformers' SDPA path
  runs one attention call per 112-pixel window (about 5,000 per 1080p image), which the split shows.
- **Batch 128 fallback.** If batch 128 runs out of memory at the reference pixel budget, it is run once more
  at `--fallback-max-pixels` (default 921,600, the area of 1280x720: 1125 tokens per screenshot) and recorded as
  such (`fallback`, with the reason); a part that runs out of time keeps what it measured before
  (decision "Subprocess parts").
- **Update at 7B.** One trajectory of N 1920x1080 steps (N = 1, then 15; all screenshots in one sequence,
  history_images null as the paper preset: 15 x 2691 = ~40k tokens), advantage 1, micro = mini batch 1,
  ppo_epochs 1, bf16 autocast: one forward + backward + optimizer step (the on-policy case of update.py,
  decision "Recomputed old log-probs": no extra old-log-prob forward). Activation checkpointing is on
  (model.py, decision "Gradient checkpointing"). The 1-step trajectory goes twice (the first call is the
  warm-up, both times recorded), the 15-step one once and again if the part has the time.
- **Engines on one GPU.** On one GPU ZeRO shards nothing: DeepSpeed keeps bf16 weights and gradients, fp32
  master weights and two fp32 Adam moments (16 bytes/param, ~124 GiB at 8.29B, close to an H200's
  ~140 GiB), ZeRO-2 also flattens the gradients to fp32 at the step (expected out of memory), ZeRO-3 works
  through sub-groups; the torch engine keeps fp32 weights, fp32 gradients and fp32 moments (16 bytes/param)
  plus autocast's bf16 weight copies (expected out of memory). Parts run in the order `gen, zero3,
  zero3-fv, zero2, fused_adam, torch`; `zero3-fv` (ZeRO-3 with the vision tower frozen, 7.6B trainable)
  runs only when ZeRO-3's largest trajectory did not fit. An out-of-memory error is a result (`oom: true`,
  the message, the memory at that point), never a crash.
- **DeepSpeed optimizer.** The DeepSpeed parts give DeepSpeed torch's fused AdamW (engines.py, decision "Torch
  AdamW option"): DeepSpeed's own FusedAdam, the trainer's default on CUDA, is compiled on first use, which
  would put an nvcc build of unknown length inside the first measured step. The `fused_adam` part builds
  that kernel on its own (nvcc and ninja are on the node) and records whether and how fast it builds and
  runs; `--ds-optimizer fused` measures the steps with it.
- **Subprocess parts.** Every part runs in its own subprocess with a time limit (gpu_bench.py, decision
  "Subprocess parts"): memory is returned between parts, and a crash, a hang or a kill loses only that
  part. A part writes its JSON after every measurement, so a part killed at its limit keeps what it had
  measured; the parent merges each part into `--out` as soon as it ends.
- **Time budget.** `--budget-s` (the shell script gives 460 s less the wheel install): a part starts only if
  its minimum (`Part.min_s`) fits in what is left and runs under min(its limit, what is left); one that
  does not fit is recorded as skipped. The limits are guesses from FLOP and byte counts, not measured.
- **Carried packages.** The node has what KINDS.md lists (NODE_PACKAGES, read 2026-11-17). It lacks
  DeepSpeed and what DeepSpeed's and the project's imports need (`CARRIED`), and its transformers 5.17 is
  too old for the project's generator: generate.py passes `cache=` and reads `.cache`, transformers
  5.20+ names (5.17 has `past_key_values`; run here against 5.17: AttributeError). So the wheels of
  transformers 5.24.0 (this venv's, the tested version; its requirements hold on the node: hub 1.33,
  tokenizers 0.23.2, safetensors 0.8.0), DeepSpeed 0.19.8 (pure Python, its CUDA ops compiled on use)
  and the rest are carried in `.gpu-offline/wheels` and installed with `pip --no-index --no-deps
  --target /tmp/site` (scripts/gpu_check_prepare.sh and scripts/gpu_check_offline.sh). torch stays the
  node's 2.11 (the project is tested on 2.13 here: not verified against 2.11). The dry run records every
  distribution it imported (`--report-imports`); tests check each is the standard library's, the node's or
  carried.
- **Dry run.** `--dry-run` runs the same functions at gpu_bench.py's TINY shape on CPU, in bf16 as on the GPU,
  DeepSpeed on gloo, with 1920x1080 screenshots under a small pixel budget (15 tokens each), batches 2 and 3, 4 new
  tokens, trajectories of 1 and 3 steps. `--in-process` runs the parts in one process (no time limits),
  as the tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import gpu_bench as gb  # noqa: E402  (stdlib only at import)

GIB = 2**30
SCREEN = (1920, 1080)
"""OSWorld's screen (width, height)."""
DRY_MAX_PIXELS = 12_544
"""The dry run's pixel budget: a 1920x1080 screenshot becomes 140x84 pixels, 15 image tokens."""
SYSTEM = "uitars"
"""The paper preset's system prompt (presets/paper.yaml)."""
REPLY = "Thought: The {w} button is near the top, so I will click it.\nAction: click(start_box='({x},{y})')"
WORDS = ("Submit", "Save", "Open", "Close", "Next", "Search", "Cancel", "Apply")


@dataclass(frozen=True)
class Part:
    kind: str
    """'gen', 'update' or 'fused_adam'."""
    limit_s: float
    min_s: float
    """Decision "Time budget": the part starts only if this much is left."""
    engine: str = ""
    zero_stage: int = 0
    freeze_vision: bool = False


PARTS: dict[str, Part] = {
    "gen": Part("gen", 170, 60),
    "zero3": Part("update", 120, 60, "deepspeed", 3),
    "zero3-fv": Part("update", 100, 60, "deepspeed", 3, freeze_vision=True),
    "zero2": Part("update", 80, 45, "deepspeed", 2),
    "fused_adam": Part("fused_adam", 90, 30),
    "torch": Part("update", 60, 30, "torch"),
}
"""Decisions "Engines on one GPU" and "Time budget", in the order they run."""
CONDITIONAL = {"zero3-fv": "zero3"}
"""A part that runs only when the named part's largest trajectory did not fit (decision "Engines on one
GPU"); it runs unconditionally when that part is not in the list."""

ENV_KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "PYTHONPATH")
"""Environment variables recorded with the results (scripts/gpu_check_offline.sh sets them)."""

NODE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
"""The Python packages of the GPU node's image (the device notes' KINDS.md, read there on 2026-11-17);
decision "Carried packages"."""

CARRIED = {
    "transformers": "the node's 5.17 lacks the cache= API of generate.py (5.20+)",
    "deepspeed": "not on the node",
    "hjson": "DeepSpeed's config reader",
    "pydantic": "DeepSpeed's config models",
    "pydantic-core": "pydantic's compiled core",
    "annotated-types": "the project's config ranges (config/check.py) and pydantic",
    "typing-inspection": "pydantic",
    "typing-extensions": "pydantic-core needs >= 4.14.1; the node's version is not known",
}
"""Distribution -> why it is carried (decision "Carried packages"); versions are this venv's."""


def normalise(dist: str) -> str:
    """PEP 503 form of a distribution name."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def carried_pins() -> list[str]:
    """`name==version` of every CARRIED distribution as installed in this environment."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in CARRIED]


# ---------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    dry_run: bool
    device: str
    shape: str
    """'qwen2.5-vl-7b' or 'tiny'."""
    max_pixels: int
    batches: tuple[int, ...]
    gen_tokens: int
    shots: tuple[int, ...]
    """Steps (screenshots) per update trajectory, smallest first."""
    fallback_max_pixels: int
    ds_optimizer: str
    """'torch' (decision "DeepSpeed optimizer") or 'fused' (DeepSpeed's FusedAdam, the trainer's default)."""
    checkpointing: bool
    bf16: bool = True
    """bf16 weights for generation and DeepSpeed, bf16 autocast in the update (decision "Random 7B
    weights"); the dry run too, on CPU."""
    min_pixels: int = gb.MIN_PIXELS

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def settings_of(args: argparse.Namespace) -> Settings:
    if args.dry_run:
        return Settings(
            dry_run=True,
            device="cpu",
            shape="tiny",
            max_pixels=DRY_MAX_PIXELS,
            batches=(2, 3),
            gen_tokens=4,
            shots=(1, 3),
            fallback_max_pixels=DRY_MAX_PIXELS // 4,
            ds_optimizer=args.ds_optimizer,
            checkpointing=not args.no_checkpointing,
        )
    return Settings(
        dry_run=False,
        device="cuda",
        shape="qwen2.5-vl-7b",
        max_pixels=args.max_pixels,
        batches=tuple(args.batches),
        gen_tokens=args.gen_tokens,
        shots=tuple(args.shots),
        fallback_max_pixels=args.fallback_max_pixels,
        ds_optimizer=args.ds_optimizer,
        checkpointing=not args.no_checkpointing,
    )


# ---------------------------------------------------------------------------------------- policy
@cache
def tokenizer():
    """The project's tiny tokenizer (gpu_bench.py, decision "Tiny tokenizer ids"); deterministic."""
    from arpo_core.policy.model import SIZES, default_corpus, train_tokenizer

    return train_tokenizer(default_corpus(), SIZES["xs"].vocab)


def build_policy(s: Settings, dtype) -> Any:
    """A `Policy` of random weights at the settings' shape, built on its device from the config
    (decision "Random 7B weights")."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from arpo_core.policy.model import Policy, PolicyProcessor

    tok = tokenizer()
    shape = gb.TINY if s.shape == "tiny" else gb.QWEN25VL_7B
    ids = {k: int(tok.convert_tokens_to_ids(t)) for k, t in gb.TOKEN_KEYS.items()}
    config = gb.hf_config(gb.qwen25vl_config(shape, ids))
    with torch.random.fork_rng(devices=[]), torch.device(s.device):
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.eval()
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels})
    return Policy(model=model, processor=PolicyProcessor(image_processor=proc, tokenizer=tok), tokenizer=tok)


def screenshot(i: int, size: tuple[int, int] = SCREEN):
    """A synthetic screen (decision "Synthetic screenshots"): a title bar, a few boxes and text lines."""
    from PIL import Image, ImageDraw

    w, h = size
    img = Image.new("RGB", (w, h), (236, 236, 236))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 0, w, 36), fill=(40, 60, 90))
    for k in range(6):
        x = (97 * (i + 1) * (k + 3)) % max(1, w - 240)
        y = 60 + (131 * (i + 2) * (k + 1)) % max(1, h - 140)
        d.rectangle((x, y, x + 220, y + 70), fill=((40 * k + 7 * i) % 256, 120, (200 - 30 * k) % 256))
        d.text((x + 12, y + 25), f"{WORDS[(i + k) % len(WORDS)]} {i}", fill=(255, 255, 255))
    for k in range(12):
        d.line((40, 200 + 60 * k, w - 40, 200 + 60 * k), fill=(200, 200, 200), width=2)
    return img


def instruction(i: int) -> str:
    return f"Open the {WORDS[i % len(WORDS)].lower()} dialog of window {i} and confirm it."


def memory(device: str) -> dict[str, float]:
    """Peak and current GPU memory since the last reset (empty on CPU)."""
    import torch

    if not device.startswith("cuda"):
        return {}
    return {
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
        "alloc_gib": round(torch.cuda.memory_allocated() / GIB, 2),
    }


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def oom_record(e: BaseException, device: str) -> dict[str, Any]:
    """Decision "Engines on one GPU": an out-of-memory error as a result."""
    return {"oom": True, "error": f"{type(e).__name__}: {str(e)[:600]}", **memory(device)}


def free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- generation
class _Timers:
    """Decision "Where the time goes": forward hooks on a module add its (synchronised) time."""

    def __init__(self, device: str):
        self.device = device
        self.total: dict[str, float] = {}
        self._t0: dict[str, float] = {}

    def attach(self, name: str, module) -> None:
        def pre(*_):
            sync(self.device)
            self._t0[name] = time.perf_counter()

        def post(*_):
            sync(self.device)
            self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - self._t0.pop(name)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def run_gen(s: Settings, emit: Callable[[str, Any], None]) -> None:
    """Generation throughput of `HFGenerator` per batch size (decisions "Project code paths", "Exact reply
    length", "Where the time goes" and "Batch 128 fallback")."""
    import torch

    import arpo_core.policy.generate as generate
    from arpo_core.policy.prompt import PromptInput, PromptSpec

    class ExactLength(generate.HFGenerator):
        def banned_ids(self) -> list[int]:
            return sorted({*super().banned_ids(), self.policy.im_end_id, self.policy.pad_id})

    t0 = time.perf_counter()
    policy = build_policy(s, torch.bfloat16 if s.bf16 else torch.float32)
    sync(s.device)
    model = policy.model
    n_params = sum(p.numel() for p in model.parameters())
    gen = ExactLength(policy, spec=PromptSpec(SYSTEM, None))
    emit(
        "model",
        {
            "params": n_params,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "build_s": round(time.perf_counter() - t0, 2),
            "lean_decoder": gen.use_lean_decoder(model),
            "attn_implementation": model.config._attn_implementation,
            "device": torch.cuda.get_device_name() if s.cuda else "cpu",
            **memory(s.device),
        },
    )
    timers = _Timers(s.device)
    timers.attach("vision", model.model.visual)
    timers.attach("lm_forward", model.model.language_model)
    image_id = policy.image_token_id
    lengths: list[tuple[int, int]] = []

    encode_prompt = generate.encode_prompt

    def encode(*a, **k):  # generate.py's own encode_prompt, timed, its sequence lengths noted
        t0 = time.perf_counter()
        seq = encode_prompt(*a, **k)
        timers.total["encode"] = timers.total.get("encode", 0.0) + time.perf_counter() - t0
        lengths.append((len(seq.input_ids), sum(1 for t in seq.input_ids if t == image_id)))
        return seq

    def call(batch: int, offset: int) -> dict[str, Any]:
        prompts = [PromptInput(instruction(offset + i), (screenshot(offset + i),)) for i in range(batch)]
        timers.total.clear()
        lengths.clear()
        reset_peak(s.device)
        with _swap(generate, "encode_prompt", encode):
            t0 = time.perf_counter()
            outs = gen.generate(
                prompts,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=s.gen_tokens,
                seeds=list(range(offset, offset + batch)),
            )
            sync(s.device)
            wall = time.perf_counter() - t0
        new = sum(len(o.token_ids) for o in outs)
        parts = {k: round(v, 3) for k, v in timers.total.items()}
        return {
            "batch": batch,
            "max_pixels": policy.max_pixels,
            "prompt_tokens_per_request": round(sum(n for n, _ in lengths) / len(lengths), 1),
            "image_tokens_per_screenshot": lengths[0][1],
            "new_tokens": new,
            "all_rows_full_length": all(len(o.token_ids) == s.gen_tokens for o in outs),
            "wall_s": round(wall, 3),
            "gen_tokens_per_s": round(new / wall, 1),
            "prompt_tokens_per_s": round(sum(n for n, _ in lengths) / wall, 1),
            "time_s": parts | {"rest": round(wall - sum(timers.total.values()), 3)},
            **memory(s.device),
        }

    warm = call(2, 10_000)  # kernels, allocator, image processor at this size
    emit("warmup", {"batch": 2, "wall_s": warm["wall_s"]})
    for b in s.batches:
        try:
            emit(f"batch_{b}", call(b, 0))
            continue
        except Exception as e:
            if not is_oom(e):
                raise
            emit(f"batch_{b}", {"batch": b, "max_pixels": policy.max_pixels, **oom_record(e, s.device)})
        free(s.device)
        if b != max(s.batches) or not s.fallback_max_pixels:
            continue
        # decision "Batch 128 fallback"
        size = dict(policy.image_processor.size)
        policy.image_processor.size = {**size, "longest_edge": s.fallback_max_pixels}
        try:
            res = call(b, 0)
            res["reason"] = f"batch {b} at max_pixels {size['longest_edge']} ran out of memory"
            emit(f"batch_{b}_fallback", res)
        except Exception as e2:
            if not is_oom(e2):
                raise
            emit(f"batch_{b}_fallback", {"batch": b, **oom_record(e2, s.device)})
        finally:
            policy.image_processor.size = size
            free(s.device)


@contextlib.contextmanager
def _swap(owner, attr: str, value):
    old = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, old)


# ---------------------------------------------------------------------------------------- update
def trajectory(n_steps: int, seed: int = 0):
    """A `Trajectory` of `n_steps` synthetic 1920x1080 steps with UI-TARS-style replies (PNG screenshots,
    as the rollouts store them)."""
    from arpo_core.trajectory import Step, Trajectory, png_bytes

    steps = [
        Step(
            step_idx=k,
            screenshot_png=png_bytes(screenshot(seed + k)),
            screen_w=SCREEN[0],
            screen_h=SCREEN[1],
            response_text=REPLY.format(w=WORDS[k % len(WORDS)], x=100 + 61 * k, y=80 + 37 * k),
            done=k == n_steps - 1,
        )
        for k in range(n_steps)
    ]
    return Trajectory(
        run_id="gpu-offline",
        stage="train",
        epoch=1,
        task_domain="synthetic",
        task_id=f"t{n_steps}",
        instruction=instruction(seed),
        steps=steps,
        reward=1.0,
        success=1.0,
    )


def run_update(s: Settings, part: Part, emit: Callable[[str, Any], None], deadline: float) -> None:
    """`ppo_update` steps through `make_engine` (decisions "Update at 7B" and "Engines on one GPU")."""
    import torch

    from arpo_core.algorithm.engines import make_engine
    from arpo_core.algorithm.update import encode_trajectories, ppo_update
    from arpo_core.config import OptimizerConfig, TrainConfig
    from arpo_core.policy.prompt import PromptSpec

    deepspeed = part.engine == "deepspeed"
    bf16 = s.bf16
    dtype = torch.bfloat16 if (deepspeed and bf16) else torch.float32  # decision "Random 7B weights"
    t0 = time.perf_counter()
    policy = build_policy(s, dtype)
    policy.set_gradient_checkpointing(s.checkpointing)
    model = policy.model
    if part.freeze_vision:
        gb._visual(model).requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    build_s = time.perf_counter() - t0
    cfg = TrainConfig(
        optimizer=OptimizerConfig(lr=1e-6, weight_decay=1e-2, max_grad_norm=1.0, bf16=bf16),
        micro_batch_size=1,
        mini_batch_size=1,
        ppo_epochs=1,
        engine=part.engine,
        zero_stage=part.zero_stage,
    )
    reset_peak(s.device)
    t0 = time.perf_counter()
    try:
        engine = make_engine(
            part.engine,
            model,
            cfg.optimizer,
            zero_stage=part.zero_stage,
            torch_adamw=s.ds_optimizer == "torch",
        )
    except Exception as e:
        if not is_oom(e):
            raise
        emit("engine", oom_record(e, s.device))
        return
    inner = getattr(engine, "optimizer", None)
    inner = getattr(inner, "optimizer", inner)  # a DeepSpeed ZeRO wrapper holds the base optimizer
    emit(
        "engine",
        {
            "engine": part.engine,
            "zero_stage": part.zero_stage if deepspeed else None,
            "optimizer": type(inner).__name__,
            "optimizer_fused": bool(getattr(inner, "defaults", {}).get("fused")),
            "params": n_params,
            "trainable_params": n_train,
            "freeze_vision": part.freeze_vision,
            "gradient_checkpointing": policy.gradient_checkpointing,
            "model_dtype": str(dtype).removeprefix("torch."),
            "bf16_autocast": cfg.optimizer.bf16,
            "build_s": round(build_s, 2),
            "init_s": round(time.perf_counter() - t0, 2),
            **memory(s.device),
        },
    )
    for n_steps in s.shots:
        traj = trajectory(n_steps)
        seqs = encode_trajectories(policy, [traj], spec=PromptSpec(SYSTEM, None))
        tokens = sum(len(q.input_ids) for q in seqs)
        image_tokens = sum(1 for q in seqs for t in q.input_ids if t == policy.image_token_id)
        rec: dict[str, Any] = {
            "screenshots": n_steps,
            "sequences": len(seqs),
            "tokens": tokens,
            "image_tokens": image_tokens,
            "runs_s": [],
        }
        repeats = 2
        k = 0
        while k < repeats:
            if k and time.time() + 1.3 * rec["runs_s"][-1] + 5 > deadline:
                rec["repeat_skipped"] = "not enough time left in the part"
                break
            reset_peak(s.device)
            t0 = time.perf_counter()
            try:
                stats = ppo_update(policy, engine, seqs, torch.tensor([1.0]), cfg, seed=k)
                sync(s.device)
            except Exception as e:
                if not is_oom(e):
                    raise
                rec.update(oom_record(e, s.device))
                emit(f"shots_{n_steps}", rec)
                return  # larger trajectories cannot fit either; the engine's state is undefined
            rec["runs_s"].append(round(time.perf_counter() - t0, 3))
            rec.update(
                loss=round(stats.loss, 5),
                grad_norm=round(stats.grad_norm, 5),
                trained_tokens=stats.n_tokens,
                **memory(s.device),
            )
            rec["step_tokens_per_s"] = round(tokens / rec["runs_s"][-1], 1)
            emit(f"shots_{n_steps}", rec)
            k += 1


# ---------------------------------------------------------------------------------------- FusedAdam
def run_fused_adam(s: Settings, emit: Callable[[str, Any], None]) -> None:
    """Decision "DeepSpeed optimizer": build DeepSpeed's FusedAdam (JIT) and take one step with it."""
    if not s.cuda:
        emit("skipped", "no CUDA: DeepSpeed's FusedAdam is a CUDA kernel")
        return
    import torch
    from deepspeed.ops.op_builder import FusedAdamBuilder

    from arpo_core.algorithm.engines import use_ds_arch_list
    from arpo_core.algorithm.jit_builds import exclusive_builds

    # engines.py, decision "Arch list for the JIT build": the node sets 9.0a, which DeepSpeed cannot parse
    changed = use_ds_arch_list()
    if changed:
        emit("arch_list", {"node": changed[0], "used": changed[1]})
    builder = FusedAdamBuilder()
    emit("compatible", bool(builder.is_compatible(verbose=False)))
    t0 = time.perf_counter()
    with exclusive_builds():  # a build killed mid-way left no lock to wait on (jit_builds.py)
        builder.load(verbose=False)
    emit("build_s", round(time.perf_counter() - t0, 1))
    from deepspeed.ops.adam import FusedAdam

    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = FusedAdam([p], lr=0.1, adam_w_mode=True, weight_decay=0.0)
    p.grad = torch.ones_like(p)
    opt.step()
    emit("step_ok", bool(torch.allclose(p.detach(), torch.full_like(p, 0.9), atol=1e-4)))


# ---------------------------------------------------------------------------------------- parts
def run_part(name: str, s: Settings, emit: Callable[[str, Any], None], deadline: float) -> None:
    part = PARTS[name]
    if part.kind == "gen":
        run_gen(s, emit)
    elif part.kind == "update":
        run_update(s, part, emit, deadline)
    else:
        run_fused_adam(s, emit)


def child(args: argparse.Namespace) -> None:
    """One part in this process, its JSON rewritten after every measurement (decision "Subprocess
    parts")."""
    from arpo_core.infra.fileio import atomic_write_json

    s = settings_of(args)
    if s.dry_run:
        import torch

        torch.set_num_threads(1)  # a shared CPU machine
    out: dict[str, Any] = {}

    def emit(key: str, value: Any) -> None:
        out[key] = value
        atomic_write_json(args.part_out, out)

    emit("started", True)
    run_part(args.part, s, emit, args.deadline)


def spawn(name: str, argv: Sequence[str], limit_s: float) -> dict[str, Any]:
    """Run part `name` in a child process under `limit_s`; its JSON, with how it ended."""
    with tempfile.TemporaryDirectory() as tmp:
        part_out = Path(tmp) / "part.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
            "--part",
            name,
            "--part-out",
            str(part_out),
            "--deadline",
            str(time.time() + limit_s),
        ]
        t0 = time.perf_counter()
        code, log = gb.run_child(cmd, limit_s, merge_output=True)  # the part and what it started end with it
        ended = (
            f"timed out after {round(limit_s)} s" if code is None else "ok" if code == 0 else f"exit {code}"
        )
        res: dict[str, Any] = json.loads(part_out.read_text()) if part_out.exists() else {}
        res.pop("started", None)
        res["ended"] = ended
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        if ended != "ok":
            res["log_tail"] = log[-3000:]
        return res


def in_process(name: str, s: Settings) -> dict[str, Any]:
    """Part `name` in this process (the tests: DeepSpeed on gloo in one process, no time limit)."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    run_part(name, s, out.__setitem__, time.time() + 3600)
    out["ended"] = "ok"
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def largest_fitted(res: dict[str, Any], s: Settings) -> bool:
    """Whether an update part's largest trajectory took a step."""
    r = res.get(f"shots_{max(s.shots)}", {})
    return bool(r.get("runs_s")) and not r.get("oom")


def machine_info() -> dict[str, Any]:
    """Machine and versions. The GPU is read with nvidia-smi, not torch: a CUDA context in this parent
    process would hold GPU memory the parts need."""
    from importlib.metadata import PackageNotFoundError, version

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if smi.returncode == 0:
            info["gpu"] = smi.stdout.strip()
    for mod in ("transformers", "deepspeed", "tokenizers", "huggingface-hub", "pydantic", "numpy", "pillow"):
        try:
            info[mod] = version(mod)
        except PackageNotFoundError:
            info[mod] = None
    import transformers

    info["transformers_path"] = str(Path(transformers.__file__).parent)
    return info


def imported_distributions() -> dict[str, str]:
    """Decision "Carried packages": every installed distribution a module of sys.modules belongs to
    (the standard library and this project left out), with its version."""
    from importlib.metadata import packages_distributions, version

    dists = packages_distributions()
    out: dict[str, str] = {}
    for mod in {m.split(".")[0] for m in list(sys.modules)}:
        if mod in sys.stdlib_module_names or (mod.startswith("_") and mod[1:] in sys.stdlib_module_names):
            continue
        path = Path(getattr(sys.modules.get(mod), "__file__", None) or "/").absolute()
        if path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / ".venv"):
            continue  # this project
        for d in dists.get(mod, []):
            out[normalise(d)] = version(d)
    return dict(sorted(out.items()))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, run in this order")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/gpu.json")
    ap.add_argument("--budget-s", type=float, default=440.0, help='decision "Time budget"')
    ap.add_argument("--dry-run", action="store_true", help='tiny shape on CPU (decision "Dry run")')
    ap.add_argument("--in-process", action="store_true", help="all parts in this process, no limits")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--shots", type=int, nargs="+", default=[1, 15])
    ap.add_argument("--max-pixels", type=int, default=gb.MAX_PIXELS)
    ap.add_argument("--fallback-max-pixels", type=int, default=921_600, help="0: no fallback")
    ap.add_argument("--ds-optimizer", choices=("torch", "fused"), default="torch")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--report-imports", action="store_true", help="record the imported distributions")
    ap.add_argument("--print-pins", action="store_true", help="print CARRIED as name==version and exit")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # child process: run one part
    ap.add_argument("--part-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    for p in args.parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r} (choose from {', '.join(PARTS)})")
    if args.out is None:
        args.out = (
            Path(tempfile.gettempdir()) / "arpo-gpu-offline" / "gpu_dry_run.json"
            if args.dry_run
            else ROOT / "benchmarks" / "results" / "gpu.json"
        )
    args.batches = sorted(args.batches)
    args.shots = sorted(args.shots)
    return args


def summary(name: str, res: dict[str, Any]) -> str:
    """One line per part for the log."""
    bits = [res.get("ended", "")]
    for k, v in res.items():
        peak = f", peak {v['peak_alloc_gib']} GiB" if isinstance(v, dict) and "peak_alloc_gib" in v else ""
        if k == "skipped" or (k == "build_s" and not isinstance(v, dict)):
            bits.append(f"{k} {v}")
        elif not isinstance(v, dict):
            continue
        elif v.get("oom"):
            bits.append(f"{k} out of memory{peak}")
        elif "gen_tokens_per_s" in v:
            bits.append(f"{k} {v['gen_tokens_per_s']} tok/s{peak}")
        elif v.get("runs_s"):
            bits.append(f"{k} {v['runs_s']} s{peak}")
    return f"[gpu_offline] {name}: " + ", ".join(b for b in bits if b)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.print_pins:
        print("\n".join(carried_pins()))
        return {}
    if args.part is not None:
        child(args)
        return {}
    from arpo_core.infra.fileio import atomic_write_json

    s = settings_of(args)
    if s.dry_run:
        import torch

        torch.set_num_threads(1)
    t_start = time.time()
    record: dict[str, Any] = {
        "benchmark": "gpu_offline",
        "command": "python benchmarks/gpu_offline.py " + " ".join(argv),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "dry_run": s.dry_run,
        "machine": machine_info(),
        "settings": dataclasses.asdict(s),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "budget_s": args.budget_s,
        "parts": {},
    }
    child_argv = [a for a in argv if a != "--report-imports"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.parts:
        spec = PARTS[name]
        parent = CONDITIONAL.get(name)
        left = args.budget_s - (time.time() - t_start)
        if parent in record["parts"] and largest_fitted(record["parts"][parent], s):
            res: dict[str, Any] = {"skipped": f"{parent}'s largest trajectory fitted"}
        elif args.in_process:
            res = in_process(name, s)
        elif left < spec.min_s and not s.dry_run:
            res = {"skipped": f"time budget: {round(left)} s left, the part needs {spec.min_s} s"}
        else:
            limit = spec.limit_s * 3 if s.dry_run else min(spec.limit_s, left)
            print(f"[gpu_offline] {name}: starting, limit {round(limit)} s", flush=True)
            # a stop from outside (the shell script's timeout) ends this process through spawn's finally
            # clause, which ends the part's process group too
            previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
            try:
                res = spawn(name, child_argv, limit)
            finally:
                signal.signal(signal.SIGTERM, previous)
        record["parts"][name] = res
        record["wall_s"] = round(time.time() - t_start, 1)
        atomic_write_json(args.out, record)  # after every part: a later kill keeps the earlier ones
        print(summary(name, res), flush=True)
    if args.report_imports:
        record["imports"] = imported_distributions()
    record["wall_s"] = round(time.time() - t_start, 1)
    atomic_write_json(args.out, record)
    print(json.dumps(record, indent=1))
    print(f"[gpu_offline] wrote {args.out}", flush=True)
    return record


if __name__ == "__main__":
    main()
