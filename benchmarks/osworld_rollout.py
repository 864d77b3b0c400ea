"""A recorded rollout of a policy on the local OSWorld-format desktop suite through the normal rollout
code (issue 7): EnvPool of OSWorldEnv workers (the project's own Xvfb desktop server), batched HF
generation, the UI-TARS parser, pyautogui code over the OSWorld HTTP protocol, the tasks' evaluators.

    .venv/bin/python benchmarks/osworld_rollout.py POLICY_DIR [--envs 2] [--max-steps 3] [--episodes 1]
    # writes benchmarks/results/osworld_rollout.json (+ trajectories and an HTML viewer under runs/)

Success is expected to be low for the embedded CPU policy (it was trained on MiniWoB only); the point is
that the whole path works end to end and what it costs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch

from arpo_core.policy.prompt import PromptSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.algorithm.rollout import RolloutConfig, make_group_jobs, run_episodes  # noqa: E402
from arpo_core.analysis.viewer import write_viewer  # noqa: E402
from arpo_core.envs.osworld.osworld_env import load_osworld_suite, make_osworld_env  # noqa: E402
from arpo_core.envs.pool import EnvPool  # noqa: E402
from arpo_core.policy.generate import HFGenerator  # noqa: E402
from arpo_core.policy.model import load_policy  # noqa: E402
from arpo_core.trajectory import write_trajectories  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("policy_dir")
    ap.add_argument("--suite", default="data/suites/osworld_local.yaml")
    ap.add_argument("--envs", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=800)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)

    policy = load_policy(args.policy_dir)
    gen = HFGenerator(policy, spec=PromptSpec("compact", None))
    tasks = load_osworld_suite(ROOT / args.suite)
    factory = functools.partial(make_osworld_env, provider="local", screen_size=(args.width, args.height))
    cfg = RolloutConfig(
        max_steps=args.max_steps,
        temperature=0.0,
        top_p=1.0,
        max_new_tokens=args.max_new_tokens,
        format_penalty=-1.0,
        min_pixels=policy.min_pixels,
        max_pixels=policy.max_pixels,
        coord_mode="absolute",
        seed=0,
    )
    t0 = time.monotonic()
    pool = EnvPool(factory, n=args.envs, reset_timeout_s=180)
    try:
        res = run_episodes(
            pool,
            gen,
            make_group_jobs(tasks, args.episodes, seed=0),
            cfg,
            run_id="osworld-local",
            stage="rollout",
        )
    finally:
        pool.close()
    wall = time.monotonic() - t0
    out_dir = ROOT / "runs" / "osworld_rollout"
    write_trajectories(out_dir / "trajectories.parquet", res.trajectories)
    write_viewer(res.trajectories, out_dir / "viewer.html", title="Local desktop rollout")
    per_task = {
        f"{t.task_domain}/{t.task_id}": {
            "success": t.success,
            "steps": len(t.steps),
            "format_error": t.format_error,
            "first_reply": t.steps[0].response_text[:160],
        }
        for t in res.trajectories
    }
    out = {
        "benchmark": "osworld_local_rollout",
        "command": f"python benchmarks/osworld_rollout.py {args.policy_dir} --envs {args.envs} --max-steps {args.max_steps}",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, 2 cores, torch {torch.__version__}",
        "policy": str(args.policy_dir),
        "screen": [args.width, args.height],
        "tasks": len(tasks),
        "wall_s": wall,
        "failed_jobs": [(j.task.task_id, err) for j, err in res.failed],
        "metrics": res.metrics,
        "per_task": per_task,
    }
    (ROOT / "benchmarks" / "results" / "osworld_rollout.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_task"}, indent=2))


if __name__ == "__main__":
    main()
