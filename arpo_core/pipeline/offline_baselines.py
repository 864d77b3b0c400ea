"""Stages `rft`, `dpo`, `kto`: the paper's offline comparisons (docs/method.md §4), each trained from the
base policy on the base policy's own baseline rollouts (the trajectories task selection sees), then
evaluated on the evaluation instances every policy shares.

Decisions:
- **One function three methods.** One function for the three methods; the stage table binds `method`. Training
  is `preference.rft / dpo / kto` with the params section of the same name.
- **Own evaluation.** Each stage evaluates its own policy (`evaluate.evaluate_policies`, same instances, keys
  by role `eval/trained/<mode>/...`, the method being the run's param `method`): a changed `train` section
  then re-runs neither these stages nor their
  evaluations, and `compare` pairs every method's episodes with the base's.
- **Skipped baselines.** Baseline rollouts may hold no usable data (RFT needs a success, DPO a task with a
  success and a failure, KTO two trajectories). Then the stage records why in `<out_dir>/skipped.json`, writes
  no policy and no evaluation, and `compare` lists the method as not trained with that reason, instead of
  the whole pipeline failing on a tiny or unlucky baseline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from arpo_core.config import Params
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.pipeline.evaluate import evaluate_policies, headline
from arpo_core.pipeline.policies import resolve_policy, setup_torch
from arpo_core.pipeline.stage import EVALUATION, TASK_DATA, Stage
from arpo_core.policy.prompt import PromptSpec
from arpo_core.trajectory import Trajectory, read_trajectories

__all__ = ["METHODS", "SKIPPED", "STAGES", "headline", "no_data_reason", "run", "train_offline"]

# `headline` (evaluate's): the offline policy is evaluated in the role `trained`, so its greedy in-domain
# success is the `_success_rate` an MLflow compare of rft / dpo / kto / arpo runs opens on.

METHODS = ("rft", "dpo", "kto")
SKIPPED = "skipped.json"


def no_data_reason(p: Params, method: str, trajs: list[Trajectory]) -> str | None:
    """Decision "Skipped baselines": why `method` cannot train on `trajs`, or None when it can."""
    from arpo_core.offline.preference import dpo_pairs, rft_select

    threshold = p.project.success_threshold
    if method == "rft":
        c = p.rft
        if not rft_select(trajs, threshold, c.max_per_task, c.seed):
            return f"no baseline rollout with success > {threshold} ({len(trajs)} rollouts)"
    elif method == "dpo":
        c = p.dpo
        if not dpo_pairs(trajs, threshold, c.max_pairs_per_task, c.seed)[0]:
            return f"no task with both a success and a failure among {len(trajs)} baseline rollouts"
    elif len(trajs) < 2:
        return f"KTO needs at least 2 baseline rollouts, got {len(trajs)}"
    return None


def _train(p: Params, method: str, policy: Any, trajs: list[Trajectory]) -> dict[str, float]:
    from arpo_core.algorithm.engines import make_engine
    from arpo_core.offline.preference import dpo, kto, rft

    kw = {
        "progress": True,
        "success_threshold": p.project.success_threshold,
        "spec": PromptSpec(p.policy.system_prompt, p.policy.history_images),
    }
    if method == "rft":
        losses = rft(policy, trajs, p.rft, **kw)
        return {"rft/loss_first": losses[0], "rft/loss_last": losses[-1], "rft/steps": float(len(losses))}
    cfg = getattr(p, method)
    engine = make_engine("torch", policy.model, cfg.optimizer)
    res = (dpo if method == "dpo" else kto)(policy, trajs, cfg, engine=engine, **kw)
    metrics = {k if k.startswith(f"{method}/") else f"{method}/{k}": float(v) for k, v in res.info.items()}
    metrics[f"{method}/examples"] = float(res.n_examples)
    if res.history:
        metrics.update({f"{method}/first/{k}": v for k, v in res.history[0].items()})
        metrics.update({f"{method}/last/{k}": v for k, v in res.history[-1].items()})
    return metrics


def train_offline(
    p: Params,
    method: str,
    policy_dir: str | os.PathLike,
    baseline_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
) -> dict[str, Any]:
    """Train `method` from the base on the baseline rollouts; the policy to `out_dir`, or `skipped.json`
    there when the rollouts hold no usable data (decision "Skipped baselines")."""
    from arpo_core.policy.model import load_policy

    if method not in METHODS:
        raise ValueError(f"unknown offline method {method!r}; choose one of {', '.join(METHODS)}")
    setup_torch(p)
    out_dir = Path(out_dir)
    trajs = read_trajectories(baseline_dir)
    reason = no_data_reason(p, method, trajs)
    if reason is not None:
        print(f"[{method}] not trained: {reason}", flush=True)
        atomic_write_json(out_dir / SKIPPED, {"method": method, "reason": reason}, indent=1)
        return {f"{method}/skipped": 1.0}
    policy = load_policy(resolve_policy(policy_dir))
    metrics = _train(p, method, policy, trajs)
    policy.save(out_dir)
    return metrics


def run(
    p: Params,
    method: str,
    policy_dir: str | os.PathLike,
    baseline_dir: str | os.PathLike,
    selected_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    eval_dir: str | os.PathLike,
) -> dict[str, Any]:
    """`train_offline`, then the policy's evaluation to `eval_dir` (decision "Own evaluation"; none when
    skipped), on the evaluate stage's splits (its `train` split: the instances the train stage trains on)."""
    metrics = train_offline(p, method, policy_dir, baseline_dir, out_dir)
    Path(eval_dir).mkdir(parents=True, exist_ok=True)
    if f"{method}/skipped" not in metrics:
        metrics.update(
            evaluate_policies(
                p, {method: out_dir}, eval_dir, roles={method: "trained"}, selected_path=selected_path
            )
        )
    return metrics


STAGES: tuple[Stage, ...] = tuple(
    Stage(
        method,
        run=run,
        params=(method, "project.success_threshold", *EVALUATION, "train.use_selection"),
        inputs={
            "policy_dir": "models/base",
            "baseline_dir": "data/baseline",
            "selected_path": "data/selected_tasks.json",
        },
        outputs={"out_dir": f"models/{method}", "eval_dir": f"data/eval_{method}"},
        artifacts={f"models/{method}": "policy", f"data/eval_{method}": "trajectories"},
        consts={"method": method},
        data=TASK_DATA,
        envs=True,
        headline=headline,
    )
    for method in METHODS
)
"""One stage per offline method (RFT, DPO, KTO), the same `run` with `method` bound."""
