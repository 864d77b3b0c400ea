"""Env-pool throughput: MiniWoB steps per second with 1, 2, 4 and 8 parallel Chromium envs.

Run from the repository root:

    .venv/bin/python benchmarks/bench_env_pool.py                 # writes benchmarks/results/env_pool.json
    .venv/bin/python benchmarks/bench_env_pool.py --sizes 1 2 --steps 10 --out /tmp/x.json

What is measured: for each pool size n, a process-backend EnvPool of n MiniWoB envs on `enter-text`
steps all envs in lock-step (one batch `step` per turn, as the rollout loop does); each step is a
coordinate click on empty space (the episode stays open), the settle check, the reward poll and a
160x210 screenshot sent back to the parent. steps/s = n * steps / wall time; the median of `--runs`
timed runs is reported, plus pool start and batch reset times. The machine's load average is recorded
because other jobs on a shared machine lower the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

from arpo_core.actions import Action
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
from arpo_core.envs.pool import EnvPool
from arpo_core.infra.fileio import atomic_write_json

TASK = TaskSpec("miniwob", "enter-text")
EMPTY_SPOT = (150.0, 205.0)  # below the enter-text form: a click there changes nothing


def bench_size(n: int, steps: int, runs: int) -> dict:
    t0 = time.perf_counter()
    pool = EnvPool(functools.partial(make_miniwob_env, episode_time_limit_s=None), n)
    start_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        res = pool.reset([(i, TASK, i) for i in range(n)])
        reset_s = time.perf_counter() - t0
        assert all(r.error is None for r in res.values()), [r.error for r in res.values()]
        batch = {i: [Action("click", point=EMPTY_SPOT)] for i in range(n)}
        for _ in range(3):  # warm-up
            pool.step(batch)
        rates = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(steps):
                out = pool.step(batch)
                assert all(r.error is None and not r.done for r in out.values())
            rates.append(n * steps / (time.perf_counter() - t0))
    finally:
        pool.close()
    return {
        "n_envs": n,
        "steps_per_s_median": round(statistics.median(rates), 2),
        "steps_per_s_runs": [round(r, 2) for r in rates],
        "step_latency_ms_median": round(1000 * n / statistics.median(rates), 1),
        "pool_start_s": round(start_s, 2),
        "batch_reset_s": round(reset_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=30, help="batch steps per timed run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/env_pool.json"))
    args = ap.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = []
    for n in args.sizes:
        r = bench_size(n, args.steps, args.runs)
        print(json.dumps(r), flush=True)
        results.append(r)
    record = {
        "benchmark": "env_pool",
        "command": "python benchmarks/bench_env_pool.py "
        + " ".join(["--sizes", *map(str, args.sizes), "--steps", str(args.steps), "--runs", str(args.runs)]),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "task": TASK.task_id,
        "step": "click on empty space + settle + reward poll + 160x210 screenshot",
        "results": results,
    }
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
