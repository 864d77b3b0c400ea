"""Soak (issue 18 item 8): MiniWoB rollouts over a real EnvPool while a background thread kills a random
browser or pool worker every few seconds. Checks that no episode is lost (every job ends as a stored
trajectory; none given up) and that every kill is counted (each kill of a live worker or browser makes
the pool replace that worker once: kills noticed = worker_restarts, plus workers found dead at close).

The policy is a scripted generator (a click at a seeded random point, then `finished()`), so the soak
measures the env system, not a model. Writes benchmarks/results/soak_rollouts.json (benchmarks/soak.py
soaks the whole pipeline).

    .venv/bin/python benchmarks/soak_rollouts.py --episodes 60 --envs 2 --kill-every 4
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.algorithm.rollout import EpisodeJob, RolloutConfig, run_episodes  # noqa: E402
from arpo_core.envs.base import TaskSpec  # noqa: E402
from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env  # noqa: E402
from arpo_core.envs.pool import EnvPool  # noqa: E402
from arpo_core.infra.fileio import atomic_write_json  # noqa: E402
from arpo_core.policy.generate import Generation  # noqa: E402
from arpo_core.trajectory import read_trajectories, write_trajectories  # noqa: E402
from benchmarks.soak import pool_targets  # noqa: E402

TASKS = ("click-test", "click-button", "click-link", "focus-text")


class ScriptedGenerator:
    """Step 0: a click at a point drawn from the step's seed; then finished()."""

    def generate(self, prompts, *, temperature, top_p, max_new_tokens, seeds=None):
        out = []
        for p, seed in zip(prompts, seeds, strict=True):
            rng = random.Random(seed)
            if p.replies:
                text = "Thought: done\nAction: finished(content='')"
            else:
                text = f"Thought: try\nAction: click(start_box='({rng.randrange(160)},{50 + rng.randrange(160)})')"
            out.append(Generation(text=text, token_ids=(), logprobs=(), finish_reason="stop"))
        return out


def killer(pool: EnvPool, stop: threading.Event, every_s: float, seed: int, log: list) -> None:
    rng = random.Random(seed)
    hit: set[int] = set()  # workers already killed or with a killed browser: one kill per worker life
    while not stop.wait(every_s):
        pids = [p for p in pool.worker_pids() if p and p not in hit]
        if not pids:
            continue
        worker = rng.choice(pids)
        browsers = pool_targets(os.getpid()).get(worker, [])  # chromedriver + main Chromium
        what, target = ("worker", worker) if rng.random() < 0.5 or not browsers else ("browser", browsers)
        try:
            if what == "worker":
                os.kill(worker, signal.SIGKILL)
            else:
                for b in target:
                    os.kill(b, signal.SIGKILL)
        except ProcessLookupError:
            continue
        hit.add(worker)
        log.append({"t": time.monotonic(), "what": what, "worker": worker})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--envs", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak_rollouts.json"))
    ap.add_argument("--trajectories", default="/tmp/arpo-soak/soak.parquet")
    a = ap.parse_args()

    jobs = [
        EpisodeJob(TaskSpec("miniwob", TASKS[i % len(TASKS)]), seed=i, group_id=i, sample_idx=0)
        for i in range(a.episodes)
    ]
    cfg = RolloutConfig(
        max_steps=3,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=64,
        format_penalty=-1.0,
        min_pixels=3136,
        max_pixels=160 * 210,
        coord_mode="absolute",
        seed=a.seed,
        env_retries=10,  # a job may be hit by several kills in a row; giving up would lose it
    )
    t0 = time.monotonic()
    kills: list = []
    stop = threading.Event()
    pool = EnvPool(functools.partial(make_miniwob_env, episode_time_limit_s=60), a.envs, reset_retries=8)
    try:
        th = threading.Thread(target=killer, args=(pool, stop, a.kill_every, a.seed, kills), daemon=True)
        th.start()
        res = run_episodes(pool, ScriptedGenerator(), jobs, cfg, run_id="soak", stage="soak")
        stop.set()
        th.join()
        before_close = pool.fault_counts()
    finally:
        stop.set()
        pool.close()
    counts = pool.fault_counts()
    dead_at_close = counts["worker_crashes"] - before_close["worker_crashes"]
    write_trajectories(a.trajectories, res.trajectories)
    stored = read_trajectories(a.trajectories)
    keys = {(t.group_id, t.task_id) for t in stored}
    doc = {
        "command": "python benchmarks/soak_rollouts.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": round(time.monotonic() - t0, 1),
        "envs": a.envs,
        "kill_every_s": a.kill_every,
        "kills": len(kills),
        "kills_by_kind": {k: sum(x["what"] == k for x in kills) for k in ("worker", "browser")},
        "faults_counted": counts,
        "worker_replacements_counted": counts["worker_restarts"],
        "rollout_env_faults": res.metrics["rollout/env_faults"],
        "episodes_expected": len(jobs),
        "episodes_stored": len(stored),
        "distinct_jobs_stored": len(keys),
        "jobs_given_up": len(res.failed),
        "episodes_lost": len(jobs) - len(keys) - len(res.failed),
        "workers_found_dead_at_close": dead_at_close,
        "kills_noticed": counts["worker_restarts"] + dead_at_close,
        "kills_equal_kills_noticed": len(kills) == counts["worker_restarts"] + dead_at_close,
    }
    atomic_write_json(a.out, doc, indent=1)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
