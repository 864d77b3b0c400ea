"""Grounding experiments: build a tiny policy, train it on grounding data, print held-out measures.

One experiment per call; each evaluation is printed as a JSON line and the whole run (config, curve,
compute) is appended to benchmarks/results/grounding_runs.jsonl. The prompt and the greedy reply length
are params.yaml's `policy` section, as in the pipeline.

    .venv/bin/python benchmarks/grounding_lab.py --name base_s --size s --steps 1500 --mix box1h=1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from arpo_core.config.sections import OptimizerConfig
from arpo_core.offline.grounding import GroundConfig, synthetic_examples, train_grounding
from arpo_core.policy.model import build_tiny_policy, count_parameters

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def prompt_settings() -> dict:
    """{system, max_new_tokens} of params.yaml's policy section (the one source of both)."""
    from arpo_core.config import load_params

    policy = load_params(ROOT / "params.yaml").policy
    return {"system": policy.system_prompt, "max_new_tokens": policy.max_new_tokens}


def parse_mix(text: str) -> dict[str, float]:
    """'box1h=1,box4=0.5' -> {'box1h': 1.0, 'box4': 0.5}."""
    return {k: float(v) for k, v in (p.split("=") for p in text.split(","))}


def parse_curriculum(text: str) -> tuple:
    """'0:box1h=1;400:box4=1' -> ((0, {...}), (400, {...}))."""
    if not text:
        return ()
    return tuple((int(s), parse_mix(m)) for s, m in (p.split(":", 1) for p in text.split(";")))


MINIWOB_TASKS = (
    "click-button",
    "click-link",
    "click-tab",
    "click-checkboxes",
    "click-option",
    "click-dialog",
    "click-widget",
    "click-collapsible",
    "identify-shape",
    "choose-list",
    "login-user",
    "enter-text",
)
"""Tasks whose screens give MiniWoB grounding targets (buttons, links, labels, tabs, texts)."""


def save_examples(examples, path: str) -> None:
    """Cache grounding examples (images as PNG bytes) so several runs share one browser pass."""
    import io
    import pickle

    rows = []
    for e in examples:
        buf = io.BytesIO()
        e.image.save(buf, "PNG")
        rows.append(
            {
                **{k: getattr(e, k) for k in ("instruction", "target", "bbox", "source", "thought")},
                "png": buf.getvalue(),
            }
        )
    with open(path, "wb") as f:
        pickle.dump(rows, f)


def dump_miniwob(path: str, first_seed: int, n_seeds: int, per_screen: int = 6) -> None:
    """Real MiniWoB grounding examples of every in-domain suite task (one browser) -> pickle.

    The cached sets of runs K/L: `--dump-miniwob train.pkl --dump-seeds 0:120` (5,814 examples, 220 s)
    and `--dump-miniwob heldout.pkl --dump-seeds 1000:6` (297 examples)."""
    from collections import Counter

    from arpo_core.envs.base import load_suite
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv
    from arpo_core.offline.grounding import miniwob_examples

    tasks = [t.task_id for t in load_suite("data/suites/miniwob_in_domain.yaml")]
    env = MiniWoBEnv()
    t = time.perf_counter()
    try:
        exs = miniwob_examples(env, tasks, range(first_seed, first_seed + n_seeds), max_per_screen=per_screen)
    finally:
        env.close()
    save_examples(exs, path)
    print(len(exs), "examples", round(time.perf_counter() - t, 1), "s", dict(Counter(e.source for e in exs)))


def load_examples(path: str) -> list:
    """The examples `save_examples` wrote."""
    import io
    import pickle

    from PIL import Image

    from arpo_core.offline.grounding import GroundExample

    with open(path, "rb") as f:
        rows = pickle.load(f)
    out = []
    for r in rows:
        img = Image.open(io.BytesIO(r["png"]))
        img.load()
        out.append(
            GroundExample(
                img, r["instruction"], tuple(r["target"]), tuple(r["bbox"]), r["source"], r["thought"]
            )
        )
    return out


def evaluate_checkpoint(path: str, levels: list[str], n: int, miniwob_seeds: int, pattern: float) -> dict:
    """Held-out measures of a saved policy on synthetic levels and (if seeds > 0) real MiniWoB screens."""
    from arpo_core.offline.grounding import evaluate_grounding, miniwob_examples
    from arpo_core.policy.model import load_policy

    policy = load_policy(path)
    prompt = prompt_settings()
    out: dict = {}
    for level in levels:
        t = time.perf_counter()
        exs = synthetic_examples(n, {level: 1.0}, seed=20_000)
        m = evaluate_grounding(policy, exs, pattern=pattern, **prompt)
        out[f"synthetic/{level}"] = {**m.as_dict(), "eval_s": round(time.perf_counter() - t, 1)}
        print(level, json.dumps(out[f"synthetic/{level}"]), flush=True)
    if miniwob_seeds:
        from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv

        env = MiniWoBEnv()
        try:
            t = time.perf_counter()
            exs = miniwob_examples(env, MINIWOB_TASKS, range(1000, 1000 + miniwob_seeds), max_per_screen=2)
            gen_s = time.perf_counter() - t
        finally:
            env.close()
        m = evaluate_grounding(policy, exs, pattern=pattern, **prompt)
        out["miniwob"] = {**m.as_dict(), "tasks": list(MINIWOB_TASKS), "data_s": round(gen_s, 1)}
        print("miniwob", json.dumps(out["miniwob"]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--eval-ckpt", default="", help="only evaluate this saved policy (writes --eval-out)")
    ap.add_argument("--eval-levels", default="box1,box1h,box4,widget1")
    ap.add_argument("--miniwob-seeds", type=int, default=0)
    ap.add_argument("--eval-out", default="")
    ap.add_argument("--size", default="s")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mix", default="box1h=1")
    ap.add_argument("--curriculum", default="")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-n", type=int, default=128)
    ap.add_argument("--eval-mix", default="")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds of training")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument(
        "--mrope",
        default="",
        help="t,h,w frequency split, e.g. 4,14,14 (with --init: re-split the loaded model's)",
    )
    ap.add_argument("--pattern", type=float, default=0.0)
    ap.add_argument(
        "--point-weight", type=float, default=0.0, help="the pointing loss beside the clicks (0: off)"
    )
    ap.add_argument("--point-heads", type=int, default=1, help="query heads the pointing loss teaches")
    ap.add_argument(
        "--place-weight", type=float, default=0.0, help="the place loss beside the clicks (0: off)"
    )
    ap.add_argument(
        "--name-weight", type=float, default=0.0, help="the naming loss beside the clicks (0: off)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--save", default="", help="save the trained policy here")
    ap.add_argument("--init", default="", help="start from this checkpoint instead of a fresh build")
    ap.add_argument(
        "--dump-miniwob", default="", help="only write real MiniWoB examples (in-domain suite) to this pickle"
    )
    ap.add_argument("--dump-seeds", default="0:120", help="first:count env seeds for --dump-miniwob")
    ap.add_argument("--grow-after", default="", help="insert zero-output layers after these, e.g. 0,1")
    ap.add_argument(
        "--min-pixels",
        type=int,
        default=0,
        help="with --init: the model image's pixel floor (0: the checkpoint's; 134400 = 2x linear on 160x210)",
    )
    ap.add_argument(
        "--eval-sets", default="", help="held-out levels measured one by one on the ground stage's screens"
    )
    ap.add_argument(
        "--miniwob-train", default="", help="pickle of real MiniWoB examples (half of each batch)"
    )
    ap.add_argument(
        "--miniwob-heldout", default="", help="pickle of held-out MiniWoB examples (the eval set)"
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.dump_miniwob:
        dump_miniwob(args.dump_miniwob, *(int(v) for v in args.dump_seeds.split(":")))
        return 0
    if args.eval_ckpt:
        res = evaluate_checkpoint(
            args.eval_ckpt, args.eval_levels.split(","), args.eval_n, args.miniwob_seeds, args.pattern
        )
        if args.eval_out:
            Path(args.eval_out).write_text(
                json.dumps({"name": args.name, "checkpoint": args.eval_ckpt, **res}, indent=1)
            )
        return 0
    if args.init:
        from arpo_core.policy.model import load_policy

        budget = {"min_pixels": args.min_pixels, "max_pixels": max(448 * 448, 2 * args.min_pixels)}
        policy = load_policy(args.init, **(budget if args.min_pixels else {}))
        if args.grow_after:
            from arpo_core.policy.model import grow_depth

            policy = grow_depth(policy, [int(v) for v in args.grow_after.split(",")])
        if args.mrope:  # re-split the trained model's rotary bands (policy/model.py resplit_mrope)
            from arpo_core.policy.model import resplit_mrope

            policy = resplit_mrope(policy, [int(v) for v in args.mrope.split(",")])
    else:
        mrope = [int(v) for v in args.mrope.split(",")] if args.mrope else None
        policy = build_tiny_policy(
            tempfile.mkdtemp(prefix="ground_"), size=args.size, rope_theta=args.rope_theta, mrope=mrope
        )
    cfg = GroundConfig(
        steps=args.steps,
        batch_size=args.batch,
        optimizer=OptimizerConfig(lr=args.lr, bf16=not args.fp32),
        warmup_steps=args.warmup,
        mix=parse_mix(args.mix),
        curriculum=parse_curriculum(args.curriculum),
        eval_every=args.eval_every,
        pattern=args.pattern,
        name_weight=args.name_weight,
        point_weight=args.point_weight,
        point_heads=args.point_heads,
        place_weight=args.place_weight,
    )
    from arpo_core.offline.grounding import SCREEN_H, SCREEN_W
    from arpo_core.pipeline.ground import held_out_screens
    from arpo_core.policy.prompt import model_image_size

    size = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
    heldout = synthetic_examples(args.eval_n, parse_mix(args.eval_mix or args.mix), 10_000, size)
    if args.eval_sets:  # the ground stage's held-out screens of each level
        heldout = {lv: held_out_screens(lv, args.eval_n, size) for lv in args.eval_sets.split(",")}
    train_fixed = load_examples(args.miniwob_train) if args.miniwob_train else None
    if args.miniwob_heldout:
        heldout = load_examples(args.miniwob_heldout)

    def show(ev: dict) -> None:
        print(json.dumps(ev), flush=True)

    prompt = prompt_settings()
    t0 = time.process_time()
    hist = train_grounding(
        policy,
        cfg,
        examples=train_fixed,
        heldout=heldout,
        time_limit_s=args.time_limit,
        callback=show,
        **prompt,
    )
    cpu = time.process_time() - t0
    if args.save:
        policy.save(args.save)
    rec = {
        "name": args.name,
        "argv": sys.argv[1:],
        "size": args.size if not args.init else f"init:{args.init}",
        "model_image": list(size),
        "params": count_parameters(policy.model),
        "config": {k: v for k, v in asdict(cfg).items()},
        "prompt": prompt,
        "threads": args.threads,
        "wall_s": round(hist["seconds"], 1),
        "cpu_s": round(cpu, 1),
        "steps": hist["steps"],
        "evals": hist["evals"],
        "loss_every_10": [
            round(sum(hist["loss"][i : i + 10]) / len(hist["loss"][i : i + 10]), 4)
            for i in range(0, len(hist["loss"]), 10)
        ],
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "grounding_runs.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    print("FINAL", json.dumps(rec["evals"][-1] if rec["evals"] else {}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
