"""Stage `demos`: scripted oracles play the in-domain suite; successful episodes to Parquet. On MiniWoB
the oracles read the DOM, and a share `demos.recovery_rate` of the episodes starts with untrained misses
(arpo_core/offline/demonstrations.py, decisions "Recovery demos" and "Untrained misses"). On OSWorld desktops
(`env.kind: osworld`, providers local and remote) the oracle is the suite's scripted `oracle` replies
(`OSWorldEnv.oracle_reply`); a desktop has no DOM, so no misses, and it is not seeded, so every episode of a
task replays the same instance. With `demos.episodes_per_task: 0` no env is started and the file is empty: the
`sft` stage then passes the grounded policy through (a pretrained checkpoint needs no behaviour cloning).
The replies are written in the policy's grammar (`policy.action_format`, `policy.coord_mode`;
demonstrations.py, decision "Demos in the policy's grammar").

Decisions:
- **Demos in the policy's frame.** A reply's click is in model-image pixels, so the oracles render it in the
  frame of the policy that clones them: the grounded policy (`models/grounded`, the stage's input; its image
  processor's pixel budget and patch size). A policy grounded at another pixel budget (`ground.min_pixels`,
  or a start checkpoint saved at one) is cloned on clicks in its own frame, and the demos are played again
  when the grounded policy changes (about a minute on the embedded default). Until 2026-12-06 the stage
  read no policy and rendered the oracles' default frame (the tiny policy's 1x): at 2x, behaviour cloning
  taught every click at half its place and the base's sampled success fell to 3-5%."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from arpo_core.algorithm.rollout import EpisodeJob
from arpo_core.config import Params
from arpo_core.config.suites import families
from arpo_core.offline.demonstrations import DemoGrammar, play_oracle_episodes
from arpo_core.pipeline.common import progress_bar, suite_tasks
from arpo_core.pipeline.policies import params_patch_factor, patch_factor, pixel_budget, resolve_policy
from arpo_core.pipeline.rollouts import make_pool, pool_faults
from arpo_core.pipeline.stage import SUITES, TASK_DATA, Stage
from arpo_core.trajectory import write_trajectories

__all__ = ["STAGE", "demo_jobs", "run"]


def demo_jobs(p: Params) -> list[EpisodeJob]:
    """Episode k of every in-domain task FAMILY on env seed `demos.seed + k`: a suite of pinned instances
    is demonstrated on other instances of the same tasks (suites.py, decision "Task families"), never on the
    pinned ones (common.py `instance_roles`), so behaviour cloning does not see the training instances."""
    return [
        EpisodeJob(t, seed=p.demos.seed + k, group_id=g, sample_idx=k)
        for g, t in enumerate(families(suite_tasks(p, "in_domain")))
        for k in range(p.demos.episodes_per_task)
    ]


def run(p: Params, out_dir: str | os.PathLike, policy_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Oracle demonstrations (successful episodes only), in the model-image frame of the policy at
    `policy_dir` (its image processor's pixel budget; default: the oracles' own)."""
    if p.demos.episodes_per_task == 0:  # no behaviour cloning: an empty file, no env started
        write_trajectories(Path(out_dir) / "demos.parquet", [])
        return {"demos/episodes": 0.0}
    if p.env.kind == "osworld" and p.env.osworld.provider == "desktop_env":
        raise ValueError(
            "demos: env.osworld.provider desktop_env (the official DesktopEnv behind the bridge) serves no "
            "oracle replies; play the demos with provider local or remote, which serve the suite's scripted "
            "`oracle` replies"
        )
    jobs = demo_jobs(p)
    min_pixels, max_pixels = pixel_budget(resolve_policy(policy_dir)) if policy_dir else (None, None)
    factor = patch_factor(resolve_policy(policy_dir)) if policy_dir else params_patch_factor(p)
    grammar = DemoGrammar(
        p.policy.action_format, p.policy.coord_mode, factor
    )  # demonstrations.py, decision "Demos in the policy's grammar"
    with make_pool(p) as pool:
        bar = progress_bar(len(jobs), "demos")
        res = play_oracle_episodes(
            pool,
            jobs,
            max_steps=p.baseline.max_steps,
            recovery_rate=p.demos.recovery_rate,
            max_misses=p.demos.max_misses,
            thoughts=p.demos.thoughts,
            grammar=grammar,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            progress=bar,
        )
        bar.close()
    # read after the close (rollouts.py, decision "Pool-life faults")
    faults = pool_faults(pool, "demos/faults")
    if not res.trajectories:
        raise RuntimeError(f"no successful demos; first errors: {res.errors[:3]}")
    write_trajectories(Path(out_dir) / "demos.parquet", res.trajectories)
    misses = [sum(not s.train_reply for s in t.steps) for t in res.trajectories]
    return {
        "demos/episodes": float(len(res.trajectories)),
        "demos/failed": float(res.n_failed),
        "demos/env_errors": float(len(res.errors)),
        "demos/steps": float(sum(len(t.steps) for t in res.trajectories)),
        "demos/recovery_episodes": float(sum(m > 0 for m in misses)),
        "demos/miss_steps": float(sum(misses)),
    } | faults


STAGE = Stage(
    "demos",
    run=run,
    params=(
        "demos",
        "baseline.max_steps",
        "policy.action_format",
        "policy.coord_mode",
        "init_policy.family",
        "init_policy.pretrained",
        *SUITES,
    ),
    inputs={"policy_dir": "models/grounded"},  # decision "Demos in the policy's frame"
    outputs={"out_dir": "data/demos"},
    artifacts={"data/demos": "trajectories"},
    data=TASK_DATA,
    envs=True,
    viewer=False,
)
