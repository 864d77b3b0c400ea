"""Overhead of the ARPO update over a bare forward + backward + optimizer step on the same batch.

    .venv/bin/python benchmarks/bench_update_overhead.py [--size s] [--batch 16] [--repeats 5]
    # writes benchmarks/results/update_overhead.json (target: within 15%)

Both sides use the same pre-encoded sequences (trajectories of 1-3 screenshots), the same micro-batch
size and the same AdamW engine. "bare" = one forward of the padded batch, a mean NLL on the assistant
tokens, backward, optimizer step. "arpo" = `update.ppo_update`: old log-probs + forward + clipped loss +
backward + step; here the update is one on-policy optimizer step, so the old log-probs are the training
forward's own (update.py, decision "Recomputed old log-probs"; before that fix they cost an extra no-grad
forward, +37%; the before/after is in the results file). Reported separately:
`arpo_no_old` (old log-probs given), which isolates the loss/bookkeeping overhead from the extra
forward that the algorithm itself asks for.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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

from arpo_core.algorithm.engines import TorchEngine  # noqa: E402
from arpo_core.algorithm.update import compute_logps, encode_trajectories, ppo_update  # noqa: E402
from arpo_core.config import TrainConfig  # noqa: E402
from arpo_core.policy.model import build_tiny_policy  # noqa: E402
from arpo_core.policy.sequences import collate, sequence_logprobs  # noqa: E402
from arpo_core.trajectory import Step, Trajectory, png_bytes  # noqa: E402


def trajectories(n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        steps = []
        for k in range(1 + i % 3):
            img = Image.new("RGB", (160, 210), "white")
            x0, y0 = 10 + 9 * k, 20 + 7 * i % 150
            ImageDraw.Draw(img).rectangle((x0, y0, x0 + 40, y0 + 30), fill=(20, 20, 200))
            reply = f"Thought: step {k} of task {i}.\nAction: click(start_box='({30 + k},{40 + i})')"
            steps.append(Step(k, png_bytes(img), 160, 210, reply))
        out.append(Trajectory("b", "train", 1, "bench", f"t{i}", "Click the blue box.", steps, sample_idx=i))
    return out


def bare_step(policy, engine, seqs, micro: int) -> None:
    n_tok = sum(sum(s.assistant_mask[1:]) for s in seqs)
    for i in range(0, len(seqs), micro):
        chunk = seqs[i : i + micro]
        batch = collate(chunk, policy.pad_id, policy.image_token_id)
        logps, mask = sequence_logprobs(policy.model, batch)
        loss = -(logps * mask).sum() / n_tok
        engine.backward(loss)
    engine.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="s")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        policy = build_tiny_policy(Path(d) / "p", size=args.size)
    policy.model.train()
    seqs = encode_trajectories(policy, trajectories(args.batch), spec=PromptSpec("compact", None))
    adv = torch.linspace(-1, 1, args.batch)
    engine = TorchEngine(policy.model, lr=1e-6, weight_decay=1e-2, max_grad_norm=1.0)
    cfg = TrainConfig(micro_batch_size=args.micro, mini_batch_size=args.batch)
    old = compute_logps(policy, seqs, micro_batch_size=args.micro, bf16=False)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    timed(lambda: bare_step(policy, engine, seqs, args.micro))  # warm-up
    bare, arpo, arpo_no_old = [], [], []
    for _ in range(args.repeats):
        bare.append(timed(lambda: bare_step(policy, engine, seqs, args.micro)))
        arpo.append(timed(lambda: ppo_update(policy, engine, seqs, adv, cfg, seed=0)))
        arpo_no_old.append(timed(lambda: ppo_update(policy, engine, seqs, adv, cfg, seed=0, old_logps=old)))
    b, a, a2 = statistics.median(bare), statistics.median(arpo), statistics.median(arpo_no_old)
    out = {
        "benchmark": "update_overhead",
        "command": f"python benchmarks/bench_update_overhead.py --size {args.size} --batch {args.batch} --repeats {args.repeats}",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)",
        "model": {"size": args.size, "parameters": sum(p.numel() for p in policy.model.parameters())},
        "batch": args.batch,
        "micro_batch": args.micro,
        "tokens_trained": sum(sum(s.assistant_mask[1:]) for s in seqs),
        "median_s": {"bare_fwd_bwd_step": b, "arpo_update": a, "arpo_update_given_old_logps": a2},
        "overhead_vs_bare": {"arpo_update": a / b - 1, "arpo_update_given_old_logps": a2 / b - 1},
        "target": "arpo_update_given_old_logps within 15% of bare; the full update adds ARPO's own no-grad forward",
    }
    print(json.dumps(out, indent=2))
    (ROOT / "benchmarks" / "results" / "update_overhead.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
