"""The reading levers, side by side (issue 33 item 2): several tiny Qwen2.5-VL policies, each a lever away
from the `xs` recipe (LM depth, vision tower width and depth, LM width, the visual resolution per
character), trained from scratch on the same reading curriculum (grounding.py, decision "Reading
curriculum") for the same wall time, concurrently on one device, with held-out curves of the named target
among look-alikes. Built for one GPU lent for minutes (every lever in its own process on the one GPU);
`--device cpu --seconds 60` is its dry run here. The CPU cost per step of each lever on this machine is
measured apart (`--cpu-cost`), since the main job runs the policy on CPU.

    # on the GPU node (the offline check's wheels on PYTHONPATH): ~5 minutes, 8 levers at once
    python benchmarks/grounding_sweep.py --device cuda --seconds 240 --out $OUT/sweep
    # here: the CPU cost per step of every lever (batch 16, one thread, as the ground stage trains)
    .venv/bin/python benchmarks/grounding_sweep.py --cpu-cost --out benchmarks/results/reading_levers_cpu.json

Decisions:
- **Same data, same clock.** Every lever sees the same stream: the same level mix, seeds and fixed list of
  real MiniWoB screens (a pickle made here with `grounding_lab.py --dump-miniwob`, carried; none on the
  node: no browser there), batch 32, lr 2e-3 after 100 warm-up steps, constant (a time-limited run has no
  last step to decay to). Levers differ in speed, so they are compared at equal wall time and at equal
  steps (the curves carry both).
- **Held-out sets.** Synthetic levels drawn with the ground stage's held-out seeds (ground.py,
  GROUND_EVAL_SEED + the level's index) and, when given, held-out real screens (env seeds 1000..). Greedy,
  `evaluate_grounding`, every `--eval-every` steps and at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MIX = {
    "box1h": 1.0,
    "widget1": 1.0,
    "box4": 1.0,
    "widget4": 1.0,
    "boxes8": 2.0,
    "buttons8": 2.0,
    "links8": 1.0,
    "texts8": 1.0,
    "checks8": 1.0,
}
"""The curriculum's one mix for the sweep (single targets to start looking, look-alikes to read)."""
EVAL_LEVELS = ("box4", "widget4", "boxes8", "buttons8", "checks8")
SCREEN_AREA = 160 * 210


def levers() -> dict[str, dict]:
    """Lever name -> build settings: a TinySize and the linear resolution factor of the model image."""
    from arpo_core.policy.model import SIZES, TinySize

    xs = SIZES["xs"]

    def size(**kw) -> TinySize:
        return TinySize(**{**asdict(xs), **kw})

    return {
        "xs": {"size": xs, "res": 1.0},
        "xs-r2": {"size": xs, "res": 2.0},
        "xs-l4": {"size": size(layers=4), "res": 1.0},
        "xs-l4-v2": {"size": size(layers=4, vision_hidden=128, vision_depth=2), "res": 1.0},
        "xs-l4-v2-r2": {"size": size(layers=4, vision_hidden=128, vision_depth=2), "res": 2.0},
        "xs-l6-v2": {"size": size(layers=6, vision_hidden=128, vision_depth=2), "res": 1.0},
        "xs-v4": {"size": size(vision_hidden=256, vision_depth=4), "res": 1.0},
        "xs-v4-r2": {"size": size(vision_hidden=256, vision_depth=4), "res": 2.0},
        "s": {"size": SIZES["s"], "res": 1.0},
        "s-r2": {"size": SIZES["s"], "res": 2.0},
    }


def build(name: str, out_dir: Path):
    """The lever's policy, built offline with rope_theta 5 and Qwen's proportional mrope split."""
    from arpo_core.policy.model import TINY_MAX_PIXELS, build_tiny_policy, mrope_section

    lv = levers()[name]
    arch = lv["size"]
    min_pixels = int(SCREEN_AREA * lv["res"] ** 2) if lv["res"] > 1 else 56 * 56
    head_dim = arch.hidden // arch.heads
    return build_tiny_policy(
        out_dir,
        size=arch,
        seed=0,
        rope_theta=5.0,
        mrope=mrope_section(head_dim),
        min_pixels=min_pixels,
        max_pixels=max(TINY_MAX_PIXELS, 2 * min_pixels),
    )


def heldout(size: tuple[int, int], n: int, real: list) -> dict[str, list]:
    from arpo_core.pipeline.ground import held_out_screens

    sets = {lv: held_out_screens(lv, n, size) for lv in EVAL_LEVELS}
    if real:
        sets["miniwob"] = real
    return sets


def rescale(examples: list, size: tuple[int, int]) -> list:
    """Examples made for the 168x224 frame, moved to the model frame `size` (targets and boxes scaled)."""
    from dataclasses import replace

    sx, sy = size[0] / 168, size[1] / 224
    return [
        replace(
            e,
            target=(e.target[0] * sx, e.target[1] * sy),
            bbox=(e.bbox[0] * sx, e.bbox[1] * sy, e.bbox[2] * sx, e.bbox[3] * sy),
        )
        for e in examples
    ]


def run_lever(name: str, args: argparse.Namespace) -> None:
    import torch
    from grounding_lab import load_examples, prompt_settings

    from arpo_core.config.sections import OptimizerConfig
    from arpo_core.offline.grounding import (
        SCREEN_H,
        SCREEN_W,
        GroundConfig,
        train_grounding,
    )
    from arpo_core.policy.model import count_parameters
    from arpo_core.policy.prompt import model_image_size

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    policy = build(name, out / f"{name}-model")
    policy.model.to(args.device)
    size = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
    train_real = rescale(load_examples(args.miniwob_train), size) if args.miniwob_train else None
    held_real = (
        rescale(load_examples(args.miniwob_heldout), size)[: 2 * args.eval_n] if args.miniwob_heldout else []
    )
    sets = heldout(size, args.eval_n, held_real)
    prompt = prompt_settings()
    config = GroundConfig(
        steps=1_000_000,
        batch_size=args.batch,
        optimizer=OptimizerConfig(lr=2e-3, bf16=args.device != "cpu"),
        warmup_steps=100,
        min_lr_frac=1.0,
        mix=MIX,
        seed=0,
        eval_every=args.eval_every,
    )
    rec = {
        "lever": name,
        "arch": asdict(levers()[name]["size"]),
        "res": levers()[name]["res"],
        "model_image": list(size),
        "image_tokens": (size[0] // policy.patch_factor) * (size[1] // policy.patch_factor),
        "parameters": count_parameters(policy.model),
        "device": args.device,
        "batch": args.batch,
        "real_train_examples": len(train_real or ()),
        "evals": [],
    }
    path = out / f"{name}.json"

    def on_eval(ev: dict) -> None:
        row = {"step": ev["step"], "seconds": ev["seconds"]}
        if "loss" in ev:  # none at step 0
            row["loss"] = round(ev["loss"], 4)
        for lv in sets:
            row[lv] = {
                k: ev[f"{lv}/{m}"]
                for k, m in (
                    ("hit", "hit_rate"),
                    ("blind", "blind_hit_rate"),
                    ("corr_x", "corr_x"),
                    ("corr_y", "corr_y"),
                )
            }
        rec["evals"].append(row)
        path.write_text(json.dumps(rec, indent=1))
        print(
            name,
            json.dumps({k: (v["hit"] if isinstance(v, dict) else v) for k, v in row.items()}),
            flush=True,
        )

    hist = train_grounding(
        policy,
        config,
        examples=train_real,
        heldout=sets,
        time_limit_s=args.seconds,
        callback=on_eval,
        **prompt,
    )
    rec["steps"] = hist["steps"]
    rec["train_eval_s"] = round(hist["seconds"], 1)
    rec["loss_every_100"] = [
        round(sum(hist["loss"][i : i + 100]) / len(hist["loss"][i : i + 100]), 4)
        for i in range(0, len(hist["loss"]), 100)
    ]
    path.write_text(json.dumps(rec, indent=1))


def cpu_cost(out: Path, steps: int, names: list[str]) -> None:
    """Seconds per training step (batch 16, one thread, fp32 + bf16 autocast as the ground stage) and per
    greedy held-out click of every lever on this machine."""
    import tempfile

    import torch
    from grounding_lab import prompt_settings

    from arpo_core.config.sections import OptimizerConfig
    from arpo_core.offline.grounding import (
        SCREEN_H,
        SCREEN_W,
        GroundConfig,
        evaluate_grounding,
        synthetic_examples,
        train_grounding,
    )
    from arpo_core.policy.model import count_parameters
    from arpo_core.policy.prompt import model_image_size

    torch.set_num_threads(1)
    prompt = prompt_settings()
    rows = {}
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            policy = build(name, Path(d))
            size = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
            cfg = GroundConfig(
                steps=steps + 2,
                batch_size=16,
                optimizer=OptimizerConfig(lr=1e-3, bf16=True),
                mix=MIX,
                eval_every=0,
            )
            hist = train_grounding(policy, cfg, **prompt)
            per_step = (hist["seconds"]) / hist["steps"]
            exs = synthetic_examples(32, {"buttons8": 1.0}, 1, size)
            t = time.perf_counter()
            evaluate_grounding(policy, exs, **prompt)
            per_click = (time.perf_counter() - t) / len(exs)
            rows[name] = {
                "parameters": count_parameters(policy.model),
                "model_image": list(size),
                "s_per_step_b16": round(per_step, 3),
                "s_per_greedy_click": round(per_click, 4),
            }
            print(name, rows[name], flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "reading_levers_cpu", "steps": steps, "levers": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levers", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--seconds", type=float, default=240.0, help="training wall time per lever")
    ap.add_argument(
        "--grace", type=float, default=150.0, help="seconds past --seconds before levers are killed"
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--miniwob-train", default="")
    ap.add_argument("--miniwob-heldout", default="")
    ap.add_argument("--cpu-cost", action="store_true")
    ap.add_argument("--cpu-steps", type=int, default=30)
    ap.add_argument("--lever", default="", help=argparse.SUPPRESS)  # a child's lever
    args = ap.parse_args()
    names = [n for n in args.levers.split(",") if n] or list(levers())
    unknown = sorted(set(names) - set(levers()))
    if unknown:
        ap.error(f"unknown lever(s) {unknown}; levers: {', '.join(levers())}")
    if args.cpu_cost:
        cpu_cost(Path(args.out), args.cpu_steps, names)
        return
    if args.lever:
        run_lever(args.lever, args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too runs the clean-up below
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for name in names:
        cmd = [
            sys.executable,
            *(["-S"] if sys.flags.no_site else []),
            __file__,
            *sys.argv[1:],
            "--lever",
            name,
        ]
        with open(out / f"{name}.log", "w") as log:  # the child holds its own copy of the descriptor
            procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)))
    deadline = time.time() + args.seconds + args.grace
    try:
        for name, pr in procs:
            try:
                pr.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(pr.pid, 9)
                pr.wait()
            print(name, "exit", pr.returncode, flush=True)
    finally:  # nothing outlives the sweep, also when it is killed itself
        for _, pr in procs:
            if pr.poll() is None:
                os.killpg(pr.pid, 9)
    summary = {}
    for name in names:
        f = out / f"{name}.json"
        if f.exists():
            rec = json.loads(f.read_text())
            last = rec["evals"][-1] if rec["evals"] else {}
            summary[name] = {
                "steps": last.get("step"),
                "parameters": rec["parameters"],
                **{k: v["hit"] for k, v in last.items() if isinstance(v, dict)},
            }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
