"""Rollout throughput: env steps/s and episodes/s of `run_episodes` with 1, 2, 4, 8 parallel MiniWoB envs,
batched inference on a real tiny policy, process and Ray backends; wall time split into env / inference
/ overhead; and a one-prompt-at-a-time generation baseline so the gain of batching shows.

Run from the repository root:

    .venv/bin/python benchmarks/bench_rollout.py            # writes benchmarks/results/rollout.json
    .venv/bin/python benchmarks/bench_rollout.py --envs 1,2 --backends process --episodes 8 \\
        --repeats 1 --out /tmp/rollout.json                # a short check

Decisions:
1. The policy is a real tiny Qwen2.5-VL (`build_tiny_policy(size='xs', rope_theta=5.0, mrope=[2,7,7])`
   in a temp dir, or `--policy DIR`) run by `HFGenerator`: inference cost is the real batched
   generation. Its replies are random text, which would end every episode at step 1 as a format error
   (no env step at all), so the generator wrapper keeps the sampled tokens and their cost but replaces
   the reply TEXT with a random `click(start_box=...)` inside the model image, drawn from the reply's
   own sampling seed (rollout.py decision 5: the same job list gives the same clicks in every mode and
   pool size). Episodes therefore run to `--max-steps` or to the task's own end, as a trained policy's
   would.
2. Every reply has exactly `--reply-tokens` tokens (the stop tokens, and all other special tokens, are
   masked out as in bench_generation.py), so inference cost does not depend on when a random model
   happens to stop.
3. Modes: `batched` is `run_episodes` as the trainer calls it (one generate call per round for every
   live episode); `one_at_a_time` is the same loop with the generator splitting each batch into
   batch-1 calls (the non-batched baseline). Same jobs, same pool.
4. Timings come from `run_episodes` metrics: `time/env_wait_s` (waiting on resets/steps/evaluations),
   `time/inference_s` (generate calls), `time/other_s` (parsing, PNG encoding of screenshots, prompt
   building, bookkeeping). A pool proxy (`TimedPool`) adds the latency of each reset / step / evaluate
   call and the time the loop sat blocked in `result()` per kind (`reset_blocked_s`: the loop waits
   for every pending reset before generating, see benchmarks/README.md). One warm-up episode per env
   runs before the timed repeats (Chromium and the page cache warm up); pool start time is reported
   separately. Medians over `--repeats`.
5. torch uses one thread (params.yaml project.torch_threads; on a busy 2-core machine more threads spin),
   and the load average before/after is recorded because other jobs lower the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generation import NoStop  # noqa: E402

from arpo_core.actions import smart_resize  # noqa: E402
from arpo_core.envs.base import TaskSpec  # noqa: E402
from arpo_core.envs.miniwob import make_miniwob_env  # noqa: E402
from arpo_core.envs.pool import EnvPool  # noqa: E402
from arpo_core.fileio import atomic_write_json  # noqa: E402
from arpo_core.policy.generate import Generation  # noqa: E402
from arpo_core.policy.prompt import PromptInput  # noqa: E402
from arpo_core.rollout import EpisodeJob, RolloutConfig, run_episodes  # noqa: E402

TASKS = ("click-test", "click-button", "click-link", "click-dialog")
"""In-domain click tasks (data/suites/miniwob_in_domain.yaml)."""


class FixedLengthGenerator(NoStop):
    """HFGenerator whose replies always have `max_new_tokens` tokens (decision 2) and never contain a
    special token: a random policy samples `<|image_pad|>` now and then, and that id fed back as reply
    history breaks the next prompt's image-token count (get_rope_index raises StopIteration)."""

    def masked_ids(self) -> list[int]:
        return sorted(self.policy.tokenizer.added_tokens_decoder)  # every special/added token id


class ClickingGenerator:
    """Real generation, reply text replaced by a random click in model-image pixels drawn from the
    prompt's own seed (decision 1).

    `one_at_a_time` splits each batch into batch-1 calls (decision 3). `batch_sizes` records the size
    of every batch the rollout loop asked for."""

    def __init__(self, inner, min_pixels: int, max_pixels: int, one_at_a_time: bool = False):
        self.inner = inner
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.one_at_a_time = one_at_a_time
        self.batch_sizes: list[int] = []

    def click_text(self, prompt: PromptInput, seed: int) -> str:
        w, h = prompt.screenshots[-1].size
        mh, mw = smart_resize(h, w, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        rng = random.Random(seed)
        x, y = rng.randrange(mw), rng.randrange(mh)
        return f"Thought: try here\nAction: click(start_box='({x},{y})')"

    def generate(self, batch: list[PromptInput], *, seeds, **kw) -> list[Generation]:
        self.batch_sizes.append(len(batch))
        if self.one_at_a_time:
            gens = [self.inner.generate([p], seeds=[s], **kw)[0] for p, s in zip(batch, seeds, strict=True)]
        else:
            gens = self.inner.generate(batch, seeds=seeds, **kw)
        return [
            Generation(self.click_text(p, s), g.token_ids, g.logprobs, g.finish_reason)
            for p, s, g in zip(batch, seeds, gens, strict=True)
        ]


class TimedPool:
    """EnvPool proxy that records each call's latency (submit -> result ready) by kind, to see where
    `time/env_wait_s` goes (a reset costs far more than a step)."""

    def __init__(self, pool: EnvPool):
        self.pool = pool
        self.n = pool.n
        self.latency: dict[str, list[float]] = {"reset": [], "step": [], "evaluate": []}
        self.blocked_s: dict[str, float] = {"reset": 0.0, "step": 0.0, "evaluate": 0.0}
        """Time the rollout loop spent inside `result()` of each kind of call."""

    def _timed(self, kind: str, fut):
        t0 = time.monotonic()
        fut.add_done_callback(lambda _f: self.latency[kind].append(time.monotonic() - t0))
        return _BlockTimer(fut, kind, self.blocked_s)

    def submit_reset(self, *a):
        return self._timed("reset", self.pool.submit_reset(*a))

    def submit_step(self, *a):
        return self._timed("step", self.pool.submit_step(*a))

    def submit_evaluate(self, *a):
        return self._timed("evaluate", self.pool.submit_evaluate(*a))


class _BlockTimer:
    """Future proxy adding the time spent waiting in `result()` to `blocked_s[kind]`."""

    def __init__(self, fut, kind: str, blocked_s: dict[str, float]):
        self.fut, self.kind, self.blocked_s = fut, kind, blocked_s

    def done(self) -> bool:
        return self.fut.done()

    def result(self, timeout=None):
        t0 = time.monotonic()
        try:
            return self.fut.result(timeout)
        finally:
            self.blocked_s[self.kind] += time.monotonic() - t0


def make_jobs(tasks: Sequence[str], episodes: int, first_seed: int) -> list[EpisodeJob]:
    """`episodes` jobs cycling over `tasks`, each with its own env seed."""
    return [
        EpisodeJob(
            TaskSpec("miniwob", tasks[i % len(tasks)], split="in_domain", backend="miniwob"), first_seed + i
        )
        for i in range(episodes)
    ]


def summarize(metrics: dict[str, float], n_steps: int, n_episodes: int) -> dict[str, float]:
    """Throughput and wall-time shares of one `run_episodes` call."""
    wall = metrics["time/rollout_s"]
    return {
        "wall_s": wall,
        "env_steps": n_steps,
        "episodes": n_episodes,
        "env_steps_per_s": n_steps / wall,
        "episodes_per_s": n_episodes / wall,
        "env_s": metrics["time/env_wait_s"],
        "inference_s": metrics["time/inference_s"],
        "other_s": metrics["time/other_s"],
        "env_frac": metrics["time/env_wait_s"] / wall,
        "inference_frac": metrics["time/inference_s"] / wall,
        "other_frac": metrics["time/other_s"] / wall,
    }


def median_summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise median of several `summarize` outputs, rounded for the results file."""
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def bench_config(policy, backend: str, n: int, mode: str, args, cfg: RolloutConfig) -> dict:
    gen = ClickingGenerator(
        FixedLengthGenerator(policy, system="compact", history_images=None),
        cfg.min_pixels,
        cfg.max_pixels,
        one_at_a_time=mode == "one_at_a_time",
    )
    kw = {"ray_resources": {"env_node": 0.01}} if backend == "ray" else {}
    t0 = time.perf_counter()
    pool = EnvPool(functools.partial(make_miniwob_env), n, backend=backend, **kw)
    start_s = time.perf_counter() - t0
    try:
        warm = run_episodes(pool, gen, make_jobs(args.tasks, n, 10_000), cfg)  # decision 4
        assert not warm.failed, warm.failed
        runs, faults = [], 0
        for rep in range(args.repeats):
            gen.batch_sizes.clear()
            timed = TimedPool(pool)
            jobs = make_jobs(args.tasks, args.episodes, 1000 * rep)
            res = run_episodes(timed, gen, jobs, cfg, epoch=rep)
            faults += len(res.failed) + int(res.metrics["rollout/env_faults"])
            steps = sum(len(t.steps) for t in res.trajectories)
            s = summarize(res.metrics, steps, len(res.trajectories))
            s["mean_batch"] = statistics.mean(gen.batch_sizes)
            s["generate_calls"] = len(gen.batch_sizes)
            for kind, lat in timed.latency.items():
                s[f"{kind}_calls"] = len(lat)
                s[f"{kind}_ms_mean"] = 1000 * statistics.mean(lat) if lat else 0.0
                s[f"{kind}_blocked_s"] = timed.blocked_s[kind]
            runs.append(s)
    finally:
        pool.close()
    out = {"backend": backend, "n_envs": n, "mode": mode, "pool_start_s": round(start_s, 2)}
    out.update(median_summary(runs))
    out["env_steps_per_s_runs"] = [round(r["env_steps_per_s"], 3) for r in runs]
    out["env_faults"] = faults
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    strs = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--envs", type=ints, default=[1, 2, 4, 8], help="pool sizes, comma-separated")
    ap.add_argument("--backends", type=strs, default=["process", "ray"])
    ap.add_argument("--modes", type=strs, default=["batched", "one_at_a_time"])
    ap.add_argument("--episodes", type=int, default=16, help="episodes per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--reply-tokens", type=int, default=32, help="tokens per reply (forced)")
    ap.add_argument("--tasks", type=strs, default=list(TASKS))
    ap.add_argument("--policy", type=Path, default=None, help="policy dir (default: build tiny xs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout.json"))
    args = ap.parse_args(argv)
    for b in args.backends:
        if b not in ("process", "ray"):
            ap.error(f"unknown backend {b!r}")
    for m in args.modes:
        if m not in ("batched", "one_at_a_time"):
            ap.error(f"unknown mode {m!r}")
    return args


def ratios(results: list[dict]) -> list[dict]:
    """Per (backend, n): batched / one_at_a_time steps/s, and each config's steps/s relative to n=1."""
    by = {(r["backend"], r["n_envs"], r["mode"]): r["env_steps_per_s"] for r in results}
    out = []
    for (b, n, m), v in by.items():
        row = {"backend": b, "n_envs": n, "mode": m}
        ref = by.get((b, 1, m), by.get((b, 1, "batched")))  # one env: both modes are the same loop
        if ref:
            row["speedup_vs_1_env"] = round(v / ref, 3)
        if m == "batched" and (b, n, "one_at_a_time") in by:
            row["batched_over_one_at_a_time"] = round(v / by[(b, n, "one_at_a_time")], 3)
        out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = [round(x, 2) for x in os.getloadavg()]
    from arpo_core.policy.model import build_tiny_policy, load_policy

    with tempfile.TemporaryDirectory() as tmp:
        if args.policy is None:
            policy = build_tiny_policy(Path(tmp) / "policy", size="xs", rope_theta=5.0, mrope=[2, 7, 7])
            policy_desc = "build_tiny_policy(size='xs', rope_theta=5.0, mrope=[2, 7, 7])"
        else:
            policy, policy_desc = load_policy(args.policy), str(args.policy)
        n_params = sum(p.numel() for p in policy.model.parameters())
        ip = policy.processor.image_processor
        cfg = RolloutConfig(
            max_steps=args.max_steps,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=args.reply_tokens,
            format_penalty=-1.0,
            min_pixels=ip.size["shortest_edge"],
            max_pixels=ip.size["longest_edge"],
            coord_mode="absolute",
            seed=0,
        )
        results = []
        for backend in args.backends:
            if backend == "ray":
                import ray

                ray.init(
                    num_cpus=os.cpu_count(),
                    include_dashboard=False,
                    log_to_driver=False,
                    resources={"env_node": 1.0},
                )
            try:
                for n in args.envs:
                    for mode in args.modes:
                        if n == 1 and mode == "one_at_a_time" and "batched" in args.modes:
                            continue  # identical to batched with one env (every batch has size 1)
                        r = bench_config(policy, backend, n, mode, args, cfg)
                        print(json.dumps(r), flush=True)
                        results.append(r)
            finally:
                if backend == "ray":
                    ray.shutdown()
    record = {
        "benchmark": "rollout",
        "command": "python benchmarks/bench_rollout.py "
        + " ".join(
            [
                "--envs",
                ",".join(map(str, args.envs)),
                "--backends",
                ",".join(args.backends),
                "--modes",
                ",".join(args.modes),
                "--episodes",
                str(args.episodes),
                "--repeats",
                str(args.repeats),
                "--max-steps",
                str(args.max_steps),
                "--reply-tokens",
                str(args.reply_tokens),
                "--tasks",
                ",".join(args.tasks),
                "--threads",
                str(args.threads),
            ]
            + (["--policy", str(args.policy)] if args.policy else [])
        ),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": args.threads,
            "cpu_count": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "policy": {"source": policy_desc, "parameters": n_params, "reply_tokens": args.reply_tokens},
        "tasks": args.tasks,
        "episode": f"max {args.max_steps} steps; each step a seeded random click in the model image",
        "results": results,
        "ratios": ratios(results),
    }
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
