"""Stage `evaluate`: the base and the trained policy on the in-domain and out-of-domain suites.

Decisions:
- **Same instances.** Every policy is evaluated on the same instances: episode k of a task runs env seed
  `evaluate.seed + k` (evaluation.py, decision "Paired evaluation seeds"), for every policy of every stage
  that calls `evaluate_policies` (this one and the offline stages rft / dpo / kto), so the `compare` stage can
  pair their episodes one by one.
- **Trajectory files and keys.** Greedy trajectories go to `<out_dir>/<name>.parquet`, sampled ones (with
  `evaluate.sampled_temperature`) to `<out_dir>/<name>-sampled.parquet`; metric keys are named by the
  policy's role, `eval/<role>/<mode>/...` (evaluate.summarize's keys under that prefix): `base` and
  `trained`, so the evaluate runs of ARPO and GRPO have the same metric names and compare column by
  column; which method was trained is the run's param `method` (`tracked_params`).
- **Method-named policy.** The trained policy is named by its method, `arpo` or `grpo`
  (`policies.method_name`): its file name, and the `method` param.
- **Evaluation splits.** The splits are common.py's (`evaluation_tasks`): with a suite of pinned instances,
  `train` (the instances the train stage trains on, read from the selection like the train stage does),
  `heldout` and `out_of_domain`; with task families, `in_domain` and `out_of_domain`.
- **Image-blind evaluation.** `train.image_blind` (the image-blind control arm) blanks every screenshot the
  TRAINED policy sees here, as it did in training; the base and the offline baselines keep their eyes, so the
  base's episodes are the same in every arm's run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arpo_core.config import Params
from arpo_core.envs.base import TaskSpec
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.pipeline.common import evaluation_tasks, instance_episodes, progress_bar, training_tasks
from arpo_core.pipeline.policies import method_name, resolve_policy, setup_torch
from arpo_core.pipeline.rollouts import generator, make_pool, pool_faults, rollout_config
from arpo_core.pipeline.stage import EVALUATION, TASK_DATA, Stage
from arpo_core.trajectory import write_trajectories

__all__ = [
    "HEADLINE_KEYS",
    "MODEL_INPUTS",
    "evaluate_loaded",
    "evaluate_policies",
    "headline",
    "run",
    "tracked_params",
    "trajectory_file",
]

MODEL_INPUTS = {"base": "base_dir", "trained": "trained_dir"}
"""Metric role -> the `run` argument holding that policy (the tracking layer links `eval/<role>/...` to
the model the stage producing that input logged)."""


def tracked_params(p: Params) -> dict[str, str]:
    """Decision "Method-named policy": the method of the trained policy, logged as a param of the stage's
    run."""
    return {"method": method_name(p)}


HEADLINE_KEYS = ("eval/trained/greedy/train/success_rate", "eval/trained/greedy/in_domain/success_rate")
"""The headline's candidates in order: the training instances of a pinned suite
(decision "Evaluation splits"), else in-domain."""


def headline(p: Params, metrics: Mapping[str, float]) -> dict[str, float]:
    """The metric a user compares first (flows/runner.py, decision "Headline metric first"): the trained
    policy's greedy success on the first split (`HEADLINE_KEYS`), as `_success_rate`."""
    key = next((k for k in HEADLINE_KEYS if k in metrics), None)
    return {"_success_rate": metrics[key]} if key else {}


def trajectory_file(out_dir: str | os.PathLike, name: str, mode: str = "greedy") -> Path:
    """Decision "Trajectory files and keys": where policy `name`'s evaluation episodes of `mode` are
    written."""
    return Path(out_dir) / (f"{name}.parquet" if mode == "greedy" else f"{name}-{mode}.parquet")


def evaluate_loaded(
    p: Params,
    pool: Any,
    policy: Any,
    policy_dir: Path,
    tasks: Sequence[TaskSpec],
    episodes_per_task: int,
    temperature: float,
    *,
    prefix: str,
    run_id: str,
    stage: str = "evaluate",
    epoch: int = 0,
) -> Any:
    """One evaluation of a loaded policy on `pool` (decision "Same instances"'s instances); returns the
    EvalResult. Shared by this stage, the offline stages and the train stage's evaluations during training."""
    from arpo_core.analysis.evaluation import Scorer, evaluate_policy

    e = p.evaluate
    gen = generator(p, policy, policy_dir)  # vllm: the process's engine, given these weights
    n = instance_episodes(p, temperature)
    bar = progress_bar(sum(n if t.pinned else episodes_per_task for t in tasks), f"{run_id} ({prefix})")
    try:
        return evaluate_policy(
            pool,
            gen,
            tasks,
            episodes_per_task,
            rollout_config(p, policy_dir, temperature, e.top_p, e.max_steps, e.seed),
            first_seed=e.seed,
            scoring=Scorer.of(e.osworld_hard, e.max_steps).rule,
            prefix=prefix,
            run_id=run_id,
            stage=stage,
            epoch=epoch,
            progress=bar,
            instance_episodes=instance_episodes(p, temperature),
        )
    finally:
        bar.close()


def evaluate_policies(
    p: Params,
    policies: Mapping[str, str | os.PathLike],
    out_dir: str | os.PathLike,
    roles: Mapping[str, str] | None = None,
    *,
    selected_path: str | os.PathLike | None = None,
    blind: Sequence[str] = (),
) -> dict[str, Any]:
    """Evaluate each named policy on every split (decisions "Same instances", "Trajectory files and keys" and
    "Evaluation splits"); returns the metrics, keyed by each policy's role (`roles[name]`, default the name).
    The policies named in `blind` see blank screenshots (decision "Image-blind evaluation")."""
    from arpo_core.policy.model import load_policy

    setup_torch(p)
    e = p.evaluate
    tasks = evaluation_tasks(p, training_tasks(p, selected_path))
    modes = [("greedy", e.temperature)] + (
        [("sampled", e.sampled_temperature)] if e.sampled_temperature else []
    )
    metrics: dict[str, Any] = {}
    with make_pool(p) as pool:
        for name, path in policies.items():
            policy_dir = resolve_policy(path)
            policy = load_policy(policy_dir)
            policy.image_blind = name in blind
            for mode, temperature in modes:
                res = evaluate_loaded(
                    p,
                    pool,
                    policy,
                    policy_dir,
                    tasks,
                    e.episodes_per_task,
                    temperature,
                    prefix=f"eval/{(roles or {}).get(name, name)}/{mode}",
                    run_id=f"evaluate-{name}",
                )
                metrics.update(res.metrics)
                if res.trajectories:
                    write_trajectories(trajectory_file(out_dir, name, mode), res.trajectories)
    # close included (rollouts.py, decision "Pool-life faults")
    return metrics | pool_faults(pool, "evaluate/env_faults")


def run(
    p: Params,
    base_dir: str | os.PathLike,
    trained_dir: str | os.PathLike,
    selected_path: str | os.PathLike,
    out_dir: str | os.PathLike,
) -> dict[str, Any]:
    """Base (`base_dir`) vs the trained policy (`trained_dir/policy`); episodes to `out_dir`."""
    m = method_name(p)
    policies = {"base": base_dir, m: Path(trained_dir) / "policy"}
    metrics = evaluate_policies(
        p,
        policies,
        out_dir,
        roles={"base": "base", m: "trained"},
        selected_path=selected_path,
        blind=[m] if p.train.image_blind else [],
    )
    atomic_write_json(Path(out_dir) / "policies.json", {k: str(v) for k, v in policies.items()}, indent=1)
    return metrics


STAGE = Stage(
    "evaluate",
    run=run,
    params=(*EVALUATION, "train.replay.enabled", "train.image_blind", "train.use_selection"),
    inputs={
        "base_dir": "models/base",
        "trained_dir": "models/arpo",
        "selected_path": "data/selected_tasks.json",
    },
    outputs={"out_dir": "data/eval"},
    artifacts={"data/eval": "trajectories"},
    data=TASK_DATA,
    envs=True,
    headline=headline,
    tracked_params=tracked_params,
    model_inputs=MODEL_INPUTS,
)
