"""Does the greedy click follow the pointing head? Per coordinate position, per screen (issue 33).

The ground stage's `point_mass` is the pointing heads' teacher-forced mass on the target averaged over
every position that predicts a character of the click, and all but two of those have read the right
digits before them (arpo_core/offline/grounding.py, decision "First digits"). This splits it: on held-out
synthetic screens (`--levels`, each scored apart) it takes the first `--heads` heads of the last layer,
teacher-forced on the screen's own reply, and reports their mass on the target at x's first character
(`x_first`: the position that has read no digit), at y's first (`y_first`), over every coordinate position
(`all`), how often the look-alike with the most mass at x's first character is the named one
(`head_right`), and beside it the greedy click (the policy's own reply): `hit`, `other` (inside another
look-alike), and `right_but_missed` (the head had the named one, the click did not hit it). Then the
click read off the same head instead of the written digits (policy/heads.py, decision "Clicks read from
the pointing head"): `cell_hit`, `cell_other` (the attended cell's centre) and `block_hit`,
`block_other` (its 3x3 block's mass-weighted centre), `guarded_hit`, `guarded_other` (the written click
where it lies within one cell of the attended one, that cell's centre elsewhere). `--real N` adds held-out
real MiniWoB screens (env seeds 1000..1000+N-1 of the in-domain tasks, `--per-screen` targets each: 6 and 6
are the 2x recipe's 90).

    .venv/bin/python benchmarks/point_positions.py --model 2x=SNAPSHOT_DIR \\
        --model "1x=assets/checkpoints/grounded-read-xs" --real 6

`NAME=DIR[:STATE.pt]` as in benchmarks/place_probe.py (a phase's training state loaded over a directory).
Screens are drawn at each policy's own pixel budget. Writes benchmarks/results/point_positions.{json,md}
(`--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def measure(policy, examples, system: str, heads: int, max_new_tokens: int) -> dict:
    """The module's measures on one level's screens (means over screens; counts as fractions)."""
    from arpo_core.offline import grounding as g

    policy.model.eval()
    replies = g.greedy_replies(policy, examples, system=system, max_new_tokens=max_new_tokens, batch_size=16)
    clicks = [g.first_click(t) for t in replies]
    points = g.attention_points(policy, examples, replies, system=system, heads=heads)
    reads = {
        name: [p.click(name, c) if p is not None else None for p, c in zip(points, clicks, strict=True)]
        for name in ("cell", "block", "guarded")
    }
    rows, kinds = [], []
    for i in range(0, len(examples), 16):
        chunk = examples[i : i + 16]
        encoded = [g._encode(policy, e, system, 0.0) for e in chunk]
        batch = g.collate(encoded, policy.pad_id, policy.image_token_id).to(policy.device)
        spans = [g.point_spans(policy, enc, e) for enc, e in zip(encoded, chunk, strict=True)]
        firsts = [g.point_spans(policy, enc, e, first=True)[0] for enc, e in zip(encoded, chunk, strict=True)]
        with torch.no_grad(), g._PointCapture(policy, heads) as capture:
            g.sequence_logprobs(policy.model, batch)
            weights = capture.log_weights([q for q, _ in spans])
        for j, (enc, e) in enumerate(zip(encoded, chunk, strict=True)):
            queries, target = spans[j]
            if not queries:
                continue
            read = {
                f"{name}_{k}": v
                for name, clicks_read in reads.items()
                for k, v in zip(
                    ("hit", "other"), g.click_outcome(clicks_read[i + j], e.bbox, e.lookalikes), strict=True
                )
            }
            w = weights[j].exp().view(heads, len(queries), -1).mean(0)  # (positions, T), heads averaged
            at = [queries.index(q) for q in firsts[j]]
            boxes = [b for b, _ in e.named] or [e.bbox]
            mass0 = [float(w[at[0], g.box_tokens(policy, enc, b)].sum()) for b in boxes]
            right = max(range(len(boxes)), key=mass0.__getitem__) == boxes.index(e.bbox)
            hit, other = g.click_outcome(clicks[i + j], e.bbox, e.lookalikes)
            rows.append(
                {
                    "x_first": float(w[at[0], target].sum()),
                    "y_first": float(w[at[-1], target].sum()),
                    "all": float(w[:, target].sum(1).mean()),
                    "head_right": right,
                    "hit": hit,
                    "other": other,
                    "right_but_missed": right and not hit,
                }
                | read
            )
            kinds.append(e.kind)
    out = _means(rows)
    if any(kinds):  # real screens: the same measures per target kind (grounding.py, "Real targets by kind")
        out["by_kind"] = {
            k: _means([r for r, rk in zip(rows, kinds, strict=True) if rk == k]) for k in sorted(set(kinds))
        }
    return out


def _means(rows: list[dict]) -> dict:
    return {k: round(sum(float(r[k]) for r in rows) / len(rows), 3) for k in rows[0]} | {"screens": len(rows)}


def main() -> None:
    from place_probe import each_model, model_args, record_head, table_head, write_record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap, "point_positions")
    ap.add_argument("--levels", default="buttons8,widget4,texts8", help="synthetic levels, each scored apart")
    ap.add_argument("--screens", type=int, default=64, help="held-out screens per level")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument(
        "--real", type=int, default=0, help="also held-out real screens: env seeds 1000..1000+N-1"
    )
    ap.add_argument("--per-screen", type=int, default=6, help="targets per real screen")
    ap.add_argument("--heads", type=int, default=1, help="the first N heads of the last layer, averaged")
    ap.add_argument(
        "--screen-cache",
        default=None,
        help="where the real screens are kept (default: params' ground.screen_cache; 'null': none)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from arpo_core.config import load_params
    from arpo_core.offline.grounding import SCREEN_H, SCREEN_W, model_image_size, synthetic_examples

    params = load_params(ROOT / "params.yaml")
    system, max_new = params.policy.system_prompt, params.policy.max_new_tokens
    rows, real = [], {}
    for name, spec, policy, t0 in each_model(args.model):
        size = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
        levels = {}
        for level in args.levels.split(","):
            exs = synthetic_examples(args.screens, {level: 1.0}, seed=args.seed, model_size=size)
            levels[level] = measure(policy, exs, system, args.heads, max_new)
        if args.real:
            if size not in real:  # one browser per pixel budget, closed before measuring
                from arpo_core.pipeline.ground import real_screens

                g = replace(params.ground, eval_miniwob_seeds=args.real, miniwob_per_screen=args.per_screen)
                if args.screen_cache is not None:
                    g = replace(g, screen_cache=None if args.screen_cache == "null" else args.screen_cache)
                real[size] = real_screens(replace(params, ground=g), size, phases=())[1]
            levels["real"] = measure(policy, real[size], system, args.heads, max_new)
        rows.append({"model": name, "spec": spec, "frame": list(size), "levels": levels})
        print(json.dumps(rows[-1] | {"seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    record = record_head("point_positions.py") | {
        "screens": args.screens,
        "heads": args.heads,
        "models": rows,
    }
    keys = ("x_first", "y_first", "all", "head_right", "hit", "other", "right_but_missed")
    keys += ("cell_hit", "cell_other", "block_hit", "block_other", "guarded_hit", "guarded_other")
    lines = [
        *table_head(
            "Pointing mass by coordinate position, and the greedy click (benchmarks/point_positions.py)",
            record,
            f"{args.screens} screens per level, seed {args.seed}, heads 1-{args.heads} of the last layer",
        ),
        "| model | level | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for r in rows:
        for level, m in r["levels"].items():
            lines.append(f"| {r['model']} | {level} | " + " | ".join(f"{m[k]:.2f}" for k in keys) + " |")
            for kind, mk in m.get("by_kind", {}).items():
                cells = " | ".join(f"{mk[k]:.2f}" for k in keys)
                lines.append(f"| {r['model']} | {level}/{kind} ({mk['screens']}) | {cells} |")
    write_record(args.out, record, lines)


if __name__ == "__main__":
    main()
