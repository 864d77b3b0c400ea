"""Stage `train`: ARPO epochs (GRPO with `train.replay.enabled=false`) from the base policy on the
selected tasks; resumes from its last epoch checkpoint.

Decisions:
- **Sections as they are.** The params sections reach the trainer as they are (`train`, `policy`); only the
  rollout settings are assembled here (rollouts.py `rollout_config`), because they combine sections with the
  checkpoint's pixel budget.
- **Global iteration step.** Per-iteration metrics go to an optional `on_metrics(step, metrics)` hook with a
  global iteration step (epoch-1) * iterations_per_epoch + iteration + 1, computed from the same task list the
  trainer iterates, so a resumed run continues the series where it stopped.
- **Logging hooks.** `epoch_history` and `artifacts` tell the orchestration layer what to log without it
  knowing the checkpoint layout: one row per completed epoch (from the last checkpoint), and the final policy,
  the trajectories, the evaluations during training and the last checkpoint.
- **Learning curves.** Learning curves: with `evaluate.during_training = N > 0` the policy being trained is
  evaluated every N epochs and after the last one, on the in-domain suite's first `during_training_episodes`
  evaluation instances per task (env seeds `evaluate.seed + k`, the evaluate stage's instances), at
  `evaluate.temperature`, on the training env pool between epochs. The metrics (`eval/in_domain/...`,
  per task `eval/task/...`) go into that epoch's history row, so they are checkpointed, survive a
  resume and reach MLflow at step = epoch; the episodes go to `out_dir/eval/epoch-NNNN.parquet` for
  paired comparisons (same instances at every evaluation and in every arm of a study). With a suite of
  pinned instances the evaluation covers the in-domain splits of common.py `evaluation_tasks`: `train` (the
  instances trained on: the learning curve of the paper's in-domain protocol) and `heldout`.
- **Buffer preload.** Buffer preload (trainer.py, decision "Buffer preload"): `train.replay.preload: baseline`
  reads the baseline stage's rollouts (an input of this stage either way, so the stage graph does not depend
  on a param) and hands them to the trainer on a fresh start.
- **Start message.** The run says where it starts: "resuming from epoch N (checkpoint)" or
  "starting at epoch 1 (why)"; the trainer has already warned, naming the file, about any damaged checkpoint
  or pointer it skipped (trainer.py, decision "Checkpoint integrity"), so a restart from scratch is never
  silent.
- **Ranks in the stage.** Data-parallel ranks (distributed.py): under `torchrun` / `deepspeed` every rank runs
  this function with the same paths; it joins the launcher's process group (`train.distributed`), plays its
  share of the groups on an env pool of its own (`env.n_envs` split over the ranks), and only rank 0 talks
  (start line, progress, per-iteration metrics, evaluations during training) and writes the final policy. Each
  rank reports its phase to `<out_dir>/ranks/` (the launcher names a dead rank's last step from it). Without a
  launcher it is the one-process run, unchanged.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arpo_core.config import Params
from arpo_core.envs.base import TaskSpec
from arpo_core.pipeline.common import evaluation_tasks, progress_bar, training_tasks
from arpo_core.pipeline.policies import method_name, resolve_policy, setup_torch
from arpo_core.pipeline.rollouts import generator, make_pool, pool_faults, rollout_config
from arpo_core.pipeline.stage import DURING_TRAINING, SUITES, TASK_DATA, Stage

__all__ = ["STAGE", "artifacts", "epoch_history", "headline", "run", "tracked_params", "training_tasks"]


def _evaluator(
    p: Params, pool: Any, policy_dir: Path, out_dir: Path, trained: list[TaskSpec]
) -> Callable[[int, Any], dict[str, Any] | None] | None:
    """Decision "Learning curves": the on_epoch hook that evaluates during training, or None when it is
    off."""
    e = p.evaluate
    if not e.during_training:
        return None
    from arpo_core.pipeline.evaluate import evaluate_loaded
    from arpo_core.trajectory import write_trajectories

    tasks = evaluation_tasks(p, trained, out_of_domain=False)

    def on_epoch(epoch: int, policy: Any) -> dict[str, Any] | None:
        if epoch % e.during_training and epoch != p.train.epochs:
            return None
        res = evaluate_loaded(
            p,
            pool,
            policy,
            policy_dir,
            tasks,
            e.during_training_episodes,
            e.temperature,
            prefix="eval",
            run_id=f"train-eval-{epoch:04d}",
            stage="train-eval",
            epoch=epoch,
        )
        write_trajectories(out_dir / "eval" / f"epoch-{epoch:04d}.parquet", res.trajectories)
        return res.metrics

    return on_epoch


def _both(
    first: Callable[[int, Any], dict[str, Any] | None] | None,
    second: Callable[[int, Any], dict[str, Any] | None] | None,
) -> Callable[[int, Any], dict[str, Any] | None] | None:
    """One on_epoch hook calling both (either may be None); their results merged."""
    hooks = [h for h in (first, second) if h is not None]
    if len(hooks) < 2:
        return hooks[0] if hooks else None

    def on_epoch(epoch: int, policy: Any) -> dict[str, Any]:
        return {k: v for h in hooks for k, v in (h(epoch, policy) or {}).items()}

    return on_epoch


def run(
    p: Params,
    policy_dir: str | os.PathLike,
    selected_path: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    baseline_dir: str | os.PathLike | None = None,
    *,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
    on_epoch: Callable[[int, Any], dict[str, Any] | None] | None = None,
    resume: bool = True,
) -> dict[str, Any]:
    """Train; the final policy to `out_dir/policy`, checkpoints to `out_dir/checkpoints`. With
    `train.replay.preload: baseline` the buffer starts with `baseline_dir`'s successes
    (decision "Buffer preload")."""
    from arpo_core.algorithm.distributed import Ranks
    from arpo_core.algorithm.trainer import latest_checkpoint, train
    from arpo_core.policy.model import load_policy
    from arpo_core.trajectory import read_trajectories

    setup_torch(p)
    d = p.train.distributed
    ranks = Ranks.from_env(timeout_s=d.timeout_s, backend=d.backend)  # decision "Ranks in the stage"
    if not ranks.main:
        on_metrics = on_epoch = None
    ckpt = (
        latest_checkpoint(out_dir) if resume and ranks.main else None
    )  # verified (trainer.py, decision "Checkpoint integrity")
    if ranks.main and ckpt is not None:
        done = json.loads((ckpt / "state.json").read_text())["epoch"]
        print(
            f"[train] resuming from epoch {done} ({ckpt}); epochs {done + 1}..{p.train.epochs} to go",
            flush=True,
        )
    elif ranks.main:  # train.py, decision "Start message": a start from scratch is always said
        why = "resume off" if not resume else f"no usable checkpoint in {Path(out_dir) / 'checkpoints'}"
        print(f"[train] starting at epoch 1 of {p.train.epochs} ({why})", flush=True)
    policy_dir = resolve_policy(policy_dir)
    tasks = training_tasks(p, selected_path)
    t = p.train
    preload = []
    if t.replay.preload == "baseline" and ckpt is None and ranks.main:  # the buffer is rank 0's
        if baseline_dir is None:
            raise ValueError("train.replay.preload is 'baseline' but no baseline rollouts were given")
        preload = read_trajectories(baseline_dir)
    seed = p.project.seed if t.seed is None else t.seed
    per_epoch = max(1, math.ceil(len(tasks) / t.tasks_per_iteration))
    on_iteration = None
    if on_metrics is not None:

        def on_iteration(epoch: int, it: int, metrics: dict[str, float]) -> None:
            on_metrics((epoch - 1) * per_epoch + it + 1, metrics)

    n_envs = min(p.env.n_envs, t.tasks_per_iteration * t.groups_per_task * t.group_size)
    n_envs = max(
        1, math.ceil(n_envs / ranks.world)
    )  # decision "Ranks in the stage": each rank its part of the envs
    if ranks.distributed:
        print(f"[train] rank {ranks.rank} of {ranks.world}: {n_envs} envs on {_device(p, ranks)}", flush=True)
    with make_pool(p, n=n_envs) as pool:
        state = train(
            policy_dir,
            tasks,
            out_dir,
            t,
            p.policy,
            pool,
            seed=seed,
            rollout=rollout_config(p, policy_dir, t.temperature, t.top_p, t.max_steps, seed),
            resume=resume,
            on_iteration=on_iteration,
            on_epoch=_both(_evaluator(p, pool, policy_dir, Path(out_dir), tasks), on_epoch)
            if ranks.main
            else None,
            progress_factory=progress_bar,
            generator_factory=lambda policy: generator(p, policy, policy_dir),
            device=_device(p, ranks),
            preload=preload,
            ranks=ranks,
            heartbeat_dir=Path(out_dir) / "ranks",
            success_threshold=p.project.success_threshold,
        )
    ranks.close()  # after a run that ended well (distributed.py, decision "Clean exit")
    if not ranks.main:
        return {"train/epochs": float(state.epoch)}
    final = Path(out_dir) / "policy"
    load_policy(Path(out_dir) / "checkpoints" / f"epoch-{state.epoch:04d}" / "policy").save(final)
    last = state.history[-1] if state.history else {}
    return {
        "train/epochs": float(state.epoch),
        **{k: v for k, v in last.items() if isinstance(v, float)},
        # this process's whole pool, close included (rollouts.py, decision "Pool-life faults")
        **pool_faults(pool, "train/env_faults"),
    }


def _device(p: Params, ranks: Any) -> str:
    """Where the trained policy lives (`train.distributed.device`): the vLLM backend colocates it on
    the GPU; auto = this rank's GPU when CUDA is available, else the CPU."""
    import torch

    want = p.train.distributed.device
    cuda = p.policy.backend == "vllm" or want == "cuda" or (want == "auto" and torch.cuda.is_available())
    return f"cuda:{ranks.local_rank}" if cuda and want != "cpu" else "cpu"


def tracked_params(p: Params) -> dict[str, str]:
    """The trained method (`arpo` with replay, `grpo` without), a param of the stage's run."""
    return {"method": method_name(p)}


def headline(p: Params, metrics: dict[str, float]) -> dict[str, float]:
    """The metric a user compares first (flows/runner.py, decision "Headline metric first"): the last epoch's
    rollout success, as `_rollout_success_rate` (not `_success_rate`: sampled training rollouts, not an
    evaluation)."""
    key = "rollout/success_rate"
    return {"_rollout_success_rate": metrics[key]} if key in metrics else {}


def epoch_history(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Decision "Logging hooks": one metrics row per completed epoch, from the last checkpoint."""
    from arpo_core.algorithm.trainer import latest_checkpoint

    ckpt = latest_checkpoint(out_dir)
    return json.loads((ckpt / "state.json").read_text())["history"] if ckpt else []


def artifacts(out_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """Decision "Logging hooks": (path, artifact dir) pairs of the run."""
    from arpo_core.algorithm.trainer import latest_checkpoint

    out = Path(out_dir)
    ckpt = latest_checkpoint(out)
    pairs = [(out / "policy", "policy"), (out / "trajectories", "trajectories")]
    if (out / "eval").exists():
        pairs.append((out / "eval", "evaluations"))
    return pairs + ([(ckpt, f"checkpoint/{ckpt.name}")] if ckpt else [])


STAGE = Stage(
    "train",
    run=run,
    params=("train", "policy", "project.seed", "project.success_threshold", *SUITES, *DURING_TRAINING),
    inputs={
        "policy_dir": "models/base",
        "selected_path": "data/selected_tasks.json",
        "baseline_dir": "data/baseline",
    },
    outputs={"out_dir": "models/arpo"},
    data=TASK_DATA,
    envs=True,
    iterations=True,
    list_artifacts=artifacts,
    headline=headline,
    tracked_params=tracked_params,
    epoch_history=epoch_history,
)
