"""Batched vs one-at-a-time generation on the tiny policy: generated tokens per second, batch 1-16.

    .venv/bin/python benchmarks/bench_generation.py [--size s] [--repeats 3]
    # writes benchmarks/results/generation.json

Every prompt is a real policy prompt (compact system prompt + one 160x210 screenshot). Generation is
forced to the full `max_new_tokens` (the stop token is masked out) so each batch produces exactly
batch x max_new_tokens tokens and batches are comparable (the stop ids are banned like the vision
tokens, so the recorded log-probs stay the raw ones). "one at a time" generates the same prompts
sequentially with batch size 1. Medians of `--repeats` runs; torch uses one thread (params.yaml
project.torch_threads) unless --threads says otherwise.

Profile (issue 19 item 4): each batch size is also timed with ONE new token (`prefill_s`: encoding,
vision tower, M-RoPE positions and the prompt forward) so the decode part is `(batched_s - prefill_s)`
over `tokens - 1` steps; `finding` in the results file says which part limits the batched speedup.
`stock_decode` repeats the batch-8 measurement with the stock transformers forward for every decode
step (generate.py, decision "Lean decode steps"), so the lean decoder's gain is on record beside the ratio;
`unshared_head` repeats it with every row's prompt head through the language model (generate.py,
decision "Shared prompt head" switched off), and times both generators' batched calls in alternation for the
gain.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from arpo_core.policy.prompt import PromptSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.config import load_params  # noqa: E402
from arpo_core.policy.generate import HFGenerator, shared_prefix_len  # noqa: E402
from arpo_core.policy.model import build_tiny_policy  # noqa: E402
from arpo_core.policy.prompt import PromptInput  # noqa: E402
from arpo_core.policy.sequences import encode_prompt  # noqa: E402


def screen(i: int) -> Image.Image:
    img = Image.new("RGB", (160, 210), "white")
    d = ImageDraw.Draw(img)
    d.rectangle(
        (10 + i * 7 % 100, 40 + i * 13 % 120, 60 + i * 7 % 100, 70 + i * 13 % 120), fill=(200, 30, 30)
    )
    d.text((10, 10), f"Click button {i}", fill="black")
    return img


class NoStop(HFGenerator):
    """Generation that never stops early, so every row yields max_new_tokens tokens: the stop ids are
    never drawn (like the vision tokens, generate.py, decision "Vision tokens banned")."""

    def banned_ids(self) -> list[int]:
        return sorted({*super().banned_ids(), self.policy.im_end_id, self.policy.pad_id})


def finding(rows: list[dict], stock: dict, unshared: dict, head: tuple[int, int]) -> str:
    """The profile's conclusion at batch 8 (issue 19 item 4), from the measured split."""
    r = next((x for x in rows if x["batch"] == 8), rows[-1])
    bound = r["one_at_a_time_s"] / r["prefill_s"]
    return (
        f"batch {r['batch']}: {r['speedup']:.2f}x over one at a time "
        f"({'meets' if r['speedup'] >= 4 else 'misses'} the 4x goal). The profile: the prompt forward "
        f"(prefill) is compute on a CPU, its work grows with the tokens of every row, and {head[0]} of a "
        f"prompt's {head[1]} tokens are the head all 8 rows share. Computing that head once per call instead of "
        f'once per row (generate.py, decision "Shared prompt head") made the batched prefill '
        f"{unshared['shared_head_gain_prefill']:.2f}x and the batched call "
        f"{unshared['shared_head_gain_batched']:.2f}x faster (A/B in alternation; without it: "
        f"{unshared['speedup']:.2f}x over one at a time); a single prompt has nothing to share, so one-at-a-time is unchanged. The "
        f"prefill is now {100 * r['prefill_frac_of_batched']:.0f}% of the batched call and batches "
        f"{r['prefill_speedup']:.2f}x (what remains per row: resizing the screenshot, the vision tower, "
        f"the row's own tokens); with free decoding the bound is one_at_a_time_s / prefill_s = "
        f"{bound:.2f}x. Decode steps run through the lean decoder "
        f'(generate.py, decision "Lean decode steps"), which made the '
        f"batched call {stock['lean_decoder_gain_batched']:.2f}x and one-at-a-time "
        f"{stock['lean_decoder_gain_one_at_a_time']:.2f}x faster than the stock forward (stock: "
        f"{stock['speedup']:.2f}x batched over one at a time): removing per-step overhead helps the "
        f"one-prompt calls most, since a batch already shared it, so the ratio falls while both get "
        f"faster. Decoding batches {r['decode_speedup']:.2f}x: per step one forward for all rows, one "
        f"vectorised inverse-CDF draw and one device-to-host copy of the tokens at the end. With one "
        f"screenshot per prompt there is no history, so KV-cache reuse across an episode's steps cannot "
        f"change this benchmark."
    )


def time_batch(gen, prompts, bs: int, repeats: int, tokens: int, sampled: dict) -> tuple[float, float]:
    """Median seconds of one batched call of `bs` prompts and of the same prompts one at a time."""
    batched, single = [], []
    for r in range(repeats):
        seeds = [1000 * r + i for i in range(bs)]
        t0 = time.perf_counter()
        out = gen.generate(prompts[:bs], max_new_tokens=tokens, seeds=seeds, **sampled)
        batched.append(time.perf_counter() - t0)
        assert all(len(g.token_ids) == tokens for g in out), "a reply stopped before the fixed length"
        t0 = time.perf_counter()
        for i in range(bs):
            gen.generate(prompts[i : i + 1], max_new_tokens=tokens, seeds=seeds[i : i + 1], **sampled)
        single.append(time.perf_counter() - t0)
    return statistics.median(batched), statistics.median(single)


def ab_batched(gen_a, gen_b, prompts, repeats: int, tokens: int, sampled: dict) -> tuple[float, float]:
    """Median seconds of one batched call of `gen_a` and of `gen_b`, timed in alternation."""
    ta, tb = [], []
    seeds = list(range(len(prompts)))
    for _ in range(repeats):
        for g, acc in ((gen_a, ta), (gen_b, tb)):
            t0 = time.perf_counter()
            g.generate(prompts, max_new_tokens=tokens, seeds=seeds, **sampled)
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser()
    p = load_params(ROOT / "params.yaml")
    ap.add_argument("--size", default=p.init_policy.size, help="default: the pipeline's (params.yaml)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=p.policy.max_new_tokens)
    ap.add_argument("--threads", type=int, default=p.project.torch_threads)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # the pipeline's architecture and rotary settings (its M-RoPE split fits its own size's head only)
    mrope = p.init_policy.mrope if args.size == p.init_policy.size else None
    with tempfile.TemporaryDirectory() as d:
        policy = build_tiny_policy(
            Path(d) / "p", size=args.size, rope_theta=p.init_policy.rope_theta, mrope=mrope
        )
    gen = NoStop(policy, spec=PromptSpec("compact", None))
    prompts = [PromptInput(f"Click button {i}", (screen(i),)) for i in range(16)]
    sampled = {"temperature": 1.0, "top_p": 1.0}
    gen.generate(prompts[:2], max_new_tokens=4, seeds=[0, 1], **sampled)  # warm-up

    rows = []
    for bs in (1, 2, 4, 8, 16):
        tb, ts = time_batch(gen, prompts, bs, args.repeats, args.tokens, sampled)
        tp, tps = time_batch(gen, prompts, bs, args.repeats, 1, sampled)  # the prefill alone
        n = bs * args.tokens
        rows.append(
            {
                "batch": bs,
                "batched_s": tb,
                "one_at_a_time_s": ts,
                "batched_tokens_per_s": n / tb,
                "one_at_a_time_tokens_per_s": n / ts,
                "speedup": ts / tb,
                "prefill_s": tp,
                "prefill_one_at_a_time_s": tps,
                "prefill_speedup": tps / tp,
                "prefill_frac_of_batched": tp / tb,
                "decode_ms_per_step_batched": 1000 * (tb - tp) / max(1, args.tokens - 1),
                "decode_speedup": (ts - tps) / max(1e-9, tb - tp),
            }
        )
        print(rows[-1], flush=True)
    # The same batch-8 measurement with the stock forward for every decode step (generate.py,
    # decision "Lean decode steps")
    stock = NoStop(policy, spec=PromptSpec("compact", None))
    stock.lean_decode = False
    tb, ts = time_batch(stock, prompts, 8, args.repeats, args.tokens, sampled)
    lean8 = next(r for r in rows if r["batch"] == 8)
    stock_row = {
        "batch": 8,
        "batched_s": tb,
        "one_at_a_time_s": ts,
        "speedup": ts / tb,
        "lean_decoder_gain_batched": tb / lean8["batched_s"],
        "lean_decoder_gain_one_at_a_time": ts / lean8["one_at_a_time_s"],
    }
    print("stock decode", stock_row, flush=True)
    # ... and with every row's prompt head through the language model (generate.py,
    # decision "Shared prompt head"): the ratio of that generator, and its batched call A/B-timed against the
    # default one in alternation (3x the repeats), since the gain (~10%) is within this machine's drift
    # between two measurements
    plain = NoStop(policy, spec=PromptSpec("compact", None))
    plain.share_prefix = False
    tb, ts = time_batch(plain, prompts, 8, args.repeats, args.tokens, sampled)
    ab = {n: ab_batched(gen, plain, prompts[:8], 3 * args.repeats, n, sampled) for n in (args.tokens, 1)}
    unshared_row = {
        "batch": 8,
        "batched_s": tb,
        "one_at_a_time_s": ts,
        "speedup": ts / tb,
        "ab_batched_s": {"shared": ab[args.tokens][0], "unshared": ab[args.tokens][1]},
        "ab_prefill_s": {"shared": ab[1][0], "unshared": ab[1][1]},
        "shared_head_gain_batched": ab[args.tokens][1] / ab[args.tokens][0],
        "shared_head_gain_prefill": ab[1][1] / ab[1][0],
    }
    print("unshared head", unshared_row, flush=True)
    seqs = [encode_prompt(policy, q, spec=PromptSpec("compact", None)) for q in prompts[:8]]
    head = (shared_prefix_len(seqs, policy.image_token_id), max(len(q.input_ids) for q in seqs))
    out = {
        "benchmark": "generation",
        "command": f"python benchmarks/bench_generation.py --size {args.size} --repeats {args.repeats} "
        f"--tokens {args.tokens} --threads {args.threads}",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)",
        "model": {
            "size": args.size,
            "rope_theta": p.init_policy.rope_theta,
            "mrope": mrope,
            "parameters": sum(x.numel() for x in policy.model.parameters()),
        },
        "tokens_per_reply": args.tokens,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "results": rows,
        "stock_decode": stock_row,
        "unshared_head": unshared_row,
        "shared_head_tokens": head[0],
        "prompt_tokens": head[1],
        "finding": finding(rows, stock_row, unshared_row, head),
    }
    print(out["finding"])
    (ROOT / "benchmarks" / "results" / "generation.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
