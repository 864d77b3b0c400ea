"""The pipeline stages as plain functions: params + input paths -> output paths + a metrics dict.

Decisions:
1. One function per DVC stage / Prefect flow / MLflow run, with the same name (docs/design.md's 1:1:1
   rule): `init_policy, ground, demos, sft, baseline, select, train, evaluate`. The orchestration layers (tasks/, flows/) only wrap these; they add retries, tracking and
   artifacts, never logic, so `arpo stage NAME`, `dvc repro` and a Prefect deployment run the same code.
2. Inputs and outputs are paths (Parquet trajectories, checkpoint directories, JSON), never tensors.
   Each function returns a flat dict of slash-namespaced metrics, also written next to its outputs.
3. Env pools are created and closed inside the stage that needs them (no process outlives a stage).
4. A pretrained checkpoint (UI-TARS-1.5-7B) is not copied: `init_policy` writes a pointer file and
   `resolve_policy` follows it.
5. `ground` (grounding pretraining) turns the start policy into `models/grounded`, the start of `sft`.
   The start is `ground.checkpoint` (the versioned grounded tiny policy) or, when that is null,
   `models/init`; `ground.phases` then train it in order (a phase may first grow the LM's depth). With no
   phases the start is copied file by file, so the output is that checkpoint bit for bit. A pretrained
   model from `init_policy` (a pointer in `models/init`) wins over `ground.checkpoint`, which is a tiny
   model: with no phases the pointer is passed on unmeasured (a 7B model's greedy clicks on hundreds of
   screens are hours of CPU, and UI-TARS is grounded by its own pretraining); with phases it is trained
   and saved like any other start.
6. `ground` always measures image dependence of its output on held-out screens (docs/method.md §7):
   synthetic levels drawn with seed 10000 + the level's index in `grounding.LEVELS` (fixed per level,
   other streams than training's, which seeds each phase with its own small `seed`) and real MiniWoB
   screens of the in-domain tasks with env seeds 1000.. (training uses 0..N-1). One browser reads every
   real screen the stage needs and is closed before training starts (decision 3). The measures are the
   stage's metrics (`ground/<level>/hit_rate`, ...) and, with the recipe and the loss curves,
   `ground_report.json` inside the checkpoint directory, so the model carries how it was made and how
   it scores.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from arpo_core.config import GroundPhase, Params
from arpo_core.demos import play_oracle_episodes
from arpo_core.envs.base import TaskSpec, load_suite
from arpo_core.envs.pool import EnvPool
from arpo_core.fileio import atomic_write_json
from arpo_core.offline import sft
from arpo_core.offline_config import GroundTrainConfig
from arpo_core.policy.model import build_tiny_policy, load_policy
from arpo_core.rollout import EpisodeJob, RolloutConfig, run_episodes
from arpo_core.selection import read_selection, select_tasks, write_selection
from arpo_core.trainer import TrainerSettings, train
from arpo_core.trajectory import read_trajectories, write_trajectories
from arpo_core.update import UpdateConfig

__all__ = [
    "STAGES",
    "baseline",
    "demos",
    "evaluate",
    "ground",
    "ground_config",
    "ground_measure_keys",
    "init_policy",
    "make_pool",
    "offline_baseline",
    "resolve_policy",
    "select",
    "sft_stage",
    "suite_tasks",
    "train_stage",
]

POINTER = "pretrained.json"


def setup_torch(p: Params) -> None:
    torch.set_num_threads(p.project.torch_threads)


def resolve_policy(path: str | os.PathLike) -> Path:
    """A checkpoint directory, following `init_policy`'s pointer file for pretrained models."""
    path = Path(path)
    pointer = path / POINTER
    if pointer.exists():
        return Path(json.loads(pointer.read_text())["path"])
    return path


def suite_tasks(p: Params, split: str) -> list[TaskSpec]:
    """Tasks of the 'in_domain' or 'out_of_domain' suite named in params."""
    path = {"in_domain": p.env.in_domain_suite, "out_of_domain": p.env.out_of_domain_suite}[split]
    return load_suite(path)


@contextmanager
def make_pool(p: Params, n: int | None = None):
    """An EnvPool for the embedded default (MiniWoB), closed on exit (decision 3)."""
    from arpo_core.envs.miniwob import make_miniwob_env

    factory = functools.partial(make_miniwob_env, episode_time_limit_s=p.env.episode_time_limit_s)
    pool = EnvPool(
        factory,
        n=n or p.env.n_envs,
        backend=p.env.backend,
        reset_timeout_s=p.env.reset_timeout_s,
        step_timeout_s=p.env.step_timeout_s,
        eval_timeout_s=p.env.eval_timeout_s,
        reset_retries=p.env.reset_retries,
        ray_resources=p.env.ray_resources or None,
    )
    try:
        yield pool
    finally:
        pool.close()


def _write_metrics(path: Path, metrics: dict[str, Any]) -> None:
    atomic_write_json(path, metrics, sort_keys=True)


def _bar(total: int, desc: str):
    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0)


def pixel_budget(policy_dir: Path) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a checkpoint's image processor without loading the model: from
    `processor_config.json` (the tiny layout) or `preprocessor_config.json` (Qwen/UI-TARS layout)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = policy_dir / name
        if f.exists():
            proc = json.loads(f.read_text())
            proc = proc.get("image_processor", proc)
            size = proc.get("size") or {}
            lo = size.get("shortest_edge", proc.get("min_pixels"))
            hi = size.get("longest_edge", proc.get("max_pixels"))
            if lo is not None and hi is not None:
                return int(lo), int(hi)
    raise FileNotFoundError(f"{policy_dir}: no image processor config with min/max pixels")


def _rollout_cfg(p: Params, policy_dir: Path, temperature: float, max_steps: int, seed: int) -> RolloutConfig:
    min_pixels, max_pixels = pixel_budget(policy_dir)
    return RolloutConfig(
        max_steps=max_steps,
        temperature=temperature,
        top_p=p.train.top_p,
        max_new_tokens=p.policy.max_new_tokens,
        format_penalty=p.train.loss.format_penalty,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        coord_mode=p.policy.coord_mode,
        seed=seed,
    )


# ------------------------------------------------------------------------------------------------
# Stages


def init_policy(p: Params, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Build the tiny offline policy, or point at a pretrained checkpoint."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if p.init_policy.pretrained:
        src = Path(p.init_policy.pretrained)
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"init_policy.pretrained: no checkpoint (config.json) at {src}")
        (out_dir / POINTER).write_text(json.dumps({"path": str(src.resolve())}))
        return {"init_policy/pretrained": 1.0}
    ip = p.init_policy
    policy = build_tiny_policy(out_dir, size=ip.size, seed=ip.seed, rope_theta=ip.rope_theta, mrope=ip.mrope)
    n = sum(x.numel() for x in policy.model.parameters())
    return {"init_policy/parameters": float(n), "init_policy/vocab": float(len(policy.tokenizer))}


# Held-out seeds of the ground stage's measures (decision 6).
GROUND_EVAL_SEED = 10_000
MINIWOB_HELDOUT_SEED = 1000
GROUND_REPORT = "ground_report.json"


def ground_config(phase: GroundPhase, system: str) -> Any:
    """The `grounding.GroundConfig` of one params phase: the shared fields copied, the level weights as
    floats, no evaluation during training (the stage measures once, at the end)."""
    from arpo_core.grounding import GroundConfig

    shared = {f.name: getattr(phase, f.name) for f in fields(GroundTrainConfig)}
    shared["mix"] = {level: float(w) for level, w in phase.mix.items()}
    return GroundConfig(**shared, system=system, eval_every=0)


def ground_measure_keys(name: str, measures: dict[str, float]) -> dict[str, float]:
    """Flat metric keys of one held-out set's measures.

    >>> ground_measure_keys("box4", {"hit_rate": 0.5, "n": 64})
    {'ground/box4/hit_rate': 0.5, 'ground/box4/n': 64.0}
    """
    return {f"ground/{name}/{k}": float(v) for k, v in measures.items()}


def _check_levels(levels: Sequence[str]) -> None:
    from arpo_core.grounding import LEVELS

    unknown = sorted(set(levels) - set(LEVELS))
    if unknown:
        raise ValueError(f"ground: unknown synthetic level(s) {unknown}; levels: {', '.join(LEVELS)}")


def _miniwob_task_ids(p: Params) -> list[str]:
    tasks = suite_tasks(p, "in_domain")
    other = sorted({t.domain for t in tasks} - {"miniwob"})
    if other:
        raise ValueError(f"ground: real-screen examples need a MiniWoB in-domain suite, got domains {other}")
    return [t.task_id for t in tasks]


def _loss_summary(losses: Sequence[float], every: int = 50) -> list[float]:
    return [
        round(sum(losses[i : i + every]) / len(losses[i : i + every]), 4)
        for i in range(0, len(losses), every)
    ]


def _real_screens(p: Params, size: tuple[int, int]) -> tuple[dict[int, list], list]:
    """Real MiniWoB grounding examples of the in-domain tasks, all read by one browser that is closed
    before training starts: ({N: examples of env seeds 0..N-1} for every phase's `miniwob_seeds`,
    held-out examples of seeds 1000..1000+eval_miniwob_seeds-1). No browser when neither is asked for."""
    from arpo_core.grounding import miniwob_examples

    g = p.ground
    counts = sorted({ph.miniwob_seeds for ph in g.phases if ph.miniwob_seeds})
    if not counts and not g.eval_miniwob_seeds:
        return {}, []
    tasks = _miniwob_task_ids(p)
    from arpo_core.envs.miniwob import MiniWoBEnv

    env = MiniWoBEnv(episode_time_limit_s=p.env.episode_time_limit_s)
    try:
        train = {n: miniwob_examples(env, tasks, range(n), size, g.miniwob_per_screen) for n in counts}
        held = range(MINIWOB_HELDOUT_SEED, MINIWOB_HELDOUT_SEED + g.eval_miniwob_seeds)
        return train, miniwob_examples(env, tasks, held, size, g.miniwob_per_screen)
    finally:
        env.close()


def ground(p: Params, policy_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Grounding pretraining (decisions 5-6): start policy -> `ground.phases` -> `out_dir` (a loadable
    checkpoint with `ground_report.json`); returns the held-out image-dependence measures."""
    from arpo_core.grounding import (
        LEVELS,
        SCREEN_H,
        SCREEN_W,
        evaluate_grounding,
        synthetic_examples,
        train_grounding,
    )
    from arpo_core.policy.model import count_parameters, grow_depth
    from arpo_core.policy.prompt import model_image_size

    setup_torch(p)
    g = p.ground
    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    _check_levels([lv for ph in g.phases for lv in ph.mix] + list(g.eval_levels))  # before any work
    pointer = policy_dir / POINTER
    if pointer.exists() and not g.phases:  # a pretrained model passes through (decision 5)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pointer, out_dir / POINTER)
        return {"ground/pretrained": 1.0}
    start = resolve_policy(policy_dir) if pointer.exists() or g.checkpoint is None else Path(g.checkpoint)
    if not (start / "config.json").exists():
        raise FileNotFoundError(f"ground: no checkpoint (config.json) at {start}")
    size = model_image_size(SCREEN_W, SCREEN_H, *pixel_budget(start))  # growing depth keeps it
    train_real, held_real = _real_screens(p, size)

    metrics: dict[str, Any] = {}
    report: dict[str, Any] = {"start": str(start), "config": asdict(g), "phases": []}
    if g.phases:
        policy = load_policy(start)
        for i, phase in enumerate(g.phases):
            if phase.grow_after:
                policy = grow_depth(policy, phase.grow_after, seed=phase.seed)
            fixed = train_real[phase.miniwob_seeds] if phase.miniwob_seeds else None
            hist = train_grounding(policy, ground_config(phase, p.policy.system_prompt), examples=fixed)
            losses = hist["loss"]
            head, tail = losses[: min(10, len(losses))], losses[-min(10, len(losses)) :]
            metrics[f"ground/phase{i}/loss_first"] = sum(head) / len(head)
            metrics[f"ground/phase{i}/loss_last"] = sum(tail) / len(tail)
            metrics[f"ground/phase{i}/seconds"] = hist["seconds"]
            report["phases"].append(
                {
                    "phase": i,
                    "steps": hist["steps"],
                    "seconds": round(hist["seconds"], 1),
                    "real_examples": len(fixed or ()),
                    "layers": policy.model.config.text_config.num_hidden_layers,
                    "loss_every_50": _loss_summary(losses),
                }
            )
        policy.save(out_dir)
    else:  # the start as it is, bit for bit
        shutil.copytree(start, out_dir, dirs_exist_ok=True)
        policy = load_policy(out_dir)

    t0 = time.perf_counter()
    measures: dict[str, dict[str, float]] = {}
    for level in g.eval_levels:
        seed = GROUND_EVAL_SEED + list(LEVELS).index(level)
        exs = synthetic_examples(g.eval_per_level, {level: 1.0}, seed, size)
        measures[level] = evaluate_grounding(policy, exs, p.policy.system_prompt).as_dict()
    if g.eval_miniwob_seeds:
        if len(held_real) >= 2:  # correlations need two points
            measures["miniwob"] = evaluate_grounding(policy, held_real, p.policy.system_prompt).as_dict()
        else:
            measures["miniwob"] = {"n": float(len(held_real))}
    for name, m in measures.items():
        metrics.update(ground_measure_keys(name, m))
    metrics["ground/eval_s"] = time.perf_counter() - t0
    metrics["ground/parameters"] = float(count_parameters(policy.model))
    metrics["ground/layers"] = float(policy.model.config.text_config.num_hidden_layers)
    metrics["ground/steps"] = float(sum(ph["steps"] for ph in report["phases"]))
    report["measures"] = measures
    atomic_write_json(out_dir / GROUND_REPORT, report, indent=1, sort_keys=True)
    return metrics


def demos(
    p: Params, out_path: str | os.PathLike, policy_dir: str | os.PathLike | None = None
) -> dict[str, Any]:
    """Oracle demonstrations on the in-domain suite (successful episodes only), in the model-image
    frame of the policy at `policy_dir` (its image processor's pixel budget; default: the oracles')."""
    tasks = suite_tasks(p, "in_domain")
    jobs = [
        EpisodeJob(t, seed=p.demos.seed + k, group_id=g, sample_idx=k)
        for g, t in enumerate(tasks)
        for k in range(p.demos.episodes_per_task)
    ]
    min_pixels, max_pixels = pixel_budget(resolve_policy(policy_dir)) if policy_dir else (None, None)
    with make_pool(p) as pool:
        bar = _bar(len(jobs), "demos")
        res = play_oracle_episodes(
            pool,
            jobs,
            max_steps=p.baseline.max_steps,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            progress=bar,
        )
        bar.close()
    if not res.trajectories:
        raise RuntimeError(f"no successful demos; first errors: {res.errors[:3]}")
    write_trajectories(out_path, res.trajectories)
    return {
        "demos/episodes": float(len(res.trajectories)),
        "demos/failed": float(res.n_failed),
        "demos/env_errors": float(len(res.errors)),
        "demos/steps": float(sum(len(t.steps) for t in res.trajectories)),
    }


def sft_stage(
    p: Params, policy_dir: str | os.PathLike, demos_path: str | os.PathLike, out_dir: str | os.PathLike
) -> dict:
    """Behaviour cloning of the (grounded) policy on the demos -> the base policy."""
    setup_torch(p)
    policy = load_policy(resolve_policy(policy_dir))
    trajs = read_trajectories(demos_path)
    history = sft(
        policy,
        trajs,
        p.sft,
        checkpoint_dir=None,
        progress=True,
        system=p.policy.system_prompt,
        history_images=p.policy.history_images,
    )
    policy.save(out_dir)
    return {"sft/loss_first": history[0], "sft/loss_last": history[-1], "sft/steps": float(len(history))}


def baseline(p: Params, policy_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """N sampled rollouts per in-domain task of the base policy (input of task selection)."""
    from arpo_core.policy.generate import HFGenerator

    setup_torch(p)
    policy_dir = resolve_policy(policy_dir)
    policy = load_policy(policy_dir)
    gen = HFGenerator(policy, system=p.policy.system_prompt, history_images=p.policy.history_images)
    tasks = suite_tasks(p, "in_domain")
    jobs = [
        EpisodeJob(t, seed=p.baseline.seed + k, group_id=g, sample_idx=k)
        for g, t in enumerate(tasks)
        for k in range(p.baseline.episodes_per_task)
    ]
    cfg = _rollout_cfg(p, policy_dir, p.baseline.temperature, p.baseline.max_steps, p.project.seed)
    with make_pool(p) as pool:
        bar = _bar(len(jobs), "baseline")
        res = run_episodes(pool, gen, jobs, cfg, run_id="baseline", stage="baseline", progress=bar)
        bar.close()
    write_trajectories(Path(out_dir) / "in_domain.parquet", res.trajectories)
    return {k.replace("rollout/", "baseline/"): v for k, v in res.metrics.items()}


def select(p: Params, baseline_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """Valuable task selection from the baseline rollouts."""
    trajs = read_trajectories(baseline_dir)
    infeasible = {t.key for t in suite_tasks(p, "in_domain") if not t.feasible}
    sel = select_tasks(trajs, p.select, infeasible=infeasible)
    write_selection(out_path, sel)
    return {"select/kept": float(len(sel.kept)), "select/tasks": float(len(sel.counts))}


def train_stage(
    p: Params,
    policy_dir: str | os.PathLike,
    selected_path: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    *,
    on_iteration: Callable[[int, int, dict[str, float]], None] | None = None,
    on_epoch: Callable[[int, Any], dict[str, Any] | None] | None = None,
    resume: bool = True,
) -> dict[str, Any]:
    """ARPO (or GRPO with train.replay.enabled=false) from the base policy; resumes by default."""
    setup_torch(p)
    policy_dir = resolve_policy(policy_dir)
    tasks = suite_tasks(p, "in_domain")
    if p.train.use_selection and selected_path is not None:
        keep = {tuple(k) for k in read_selection(selected_path).kept}
        tasks = [t for t in tasks if t.key in keep]
        if not tasks:
            raise RuntimeError(f"task selection {selected_path} kept no task: nothing to train on")
    t = p.train
    settings = TrainerSettings(
        epochs=t.epochs,
        tasks_per_iteration=t.tasks_per_iteration,
        group_size=t.group_size,
        lr=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        engine=t.engine,
        zero_stage=t.zero_stage,
        advantage_scale=t.loss.advantage_scale,
        advantage_eps=t.loss.advantage_eps,
        skip_zero_advantage=t.skip_zero_advantage,
        system=p.policy.system_prompt,
        history_images=p.policy.history_images,
        seed=p.project.seed,
        update=UpdateConfig(
            micro_batch_size=t.micro_batch_size,
            mini_batch_size=t.mini_batch_size,
            ppo_epochs=t.ppo_epochs,
            clip_low=t.loss.clip_low,
            clip_high=t.loss.clip_high,
            clip_dual=t.loss.clip_dual,
            kl_coef=t.loss.kl_coef,
            kl_estimator=t.loss.kl_estimator,
            agg=t.loss.agg,
            sum_norm=t.loss.sum_norm,
            bf16=t.bf16,
        ),
        rollout=_rollout_cfg(p, policy_dir, t.temperature, t.max_steps, p.project.seed),
        replay=t.replay,
    )
    with make_pool(p, n=min(p.env.n_envs, t.tasks_per_iteration * t.group_size)) as pool:
        state = train(
            policy_dir,
            tasks,
            out_dir,
            settings,
            pool,
            resume=resume,
            on_iteration=on_iteration,
            on_epoch=on_epoch,
            progress_factory=_bar,
        )
    final = Path(out_dir) / "policy"
    load_policy(Path(out_dir) / "checkpoints" / f"epoch-{state.epoch:04d}" / "policy").save(final)
    last = state.history[-1] if state.history else {}
    return {"train/epochs": float(state.epoch), **{k: v for k, v in last.items() if isinstance(v, float)}}


def evaluate(
    p: Params,
    policies: dict[str, str | os.PathLike],
    out_dir: str | os.PathLike,
    metrics_path: str | os.PathLike,
) -> dict[str, Any]:
    """Success of each named policy (e.g. base, arpo) on the in-domain and out-of-domain suites, greedy
    (and sampled when evaluate.sampled_temperature is set); trajectories to `out_dir/<name>.parquet`,
    metrics (with 95% intervals, per task / domain / split) to `metrics_path`."""
    from arpo_core.evaluate import evaluate_policy
    from arpo_core.policy.generate import HFGenerator

    setup_torch(p)
    e = p.evaluate
    tasks = suite_tasks(p, "in_domain") + suite_tasks(p, "out_of_domain")
    modes = [("greedy", e.temperature)] + (
        [("sampled", e.sampled_temperature)] if e.sampled_temperature else []
    )
    metrics: dict[str, Any] = {}
    with make_pool(p) as pool:
        for name, path in policies.items():
            policy_dir = resolve_policy(path)
            gen = HFGenerator(
                load_policy(policy_dir), system=p.policy.system_prompt, history_images=p.policy.history_images
            )
            trajs = []
            for mode, temperature in modes:
                bar = _bar(len(tasks) * e.episodes_per_task, f"evaluate {name} {mode}")
                res = evaluate_policy(
                    pool,
                    gen,
                    tasks,
                    e.episodes_per_task,
                    temperature,
                    e.seed,
                    rollout=_rollout_cfg(p, policy_dir, temperature, e.max_steps, e.seed),
                    scoring="osworld_hard" if e.osworld_hard else "standard",
                    prefix=f"eval/{name}/{mode}",
                    run_id=f"evaluate-{name}",
                    progress=bar,
                )
                bar.close()
                metrics.update(res.metrics)
                trajs += res.trajectories
            if trajs:
                write_trajectories(Path(out_dir) / f"{name}.parquet", trajs)
    _write_metrics(Path(metrics_path), metrics)
    return metrics


def offline_baseline(
    p: Params,
    method: str,
    policy_dir: str | os.PathLike,
    baseline_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
) -> dict[str, Any]:
    """The paper's offline comparisons, trained from the base policy on its own baseline rollouts (the
    same trajectories task selection sees): `rft` (SFT on successes), `dpo` (success vs failure of the
    same task, reference = base), `kto` (desirable / undesirable, unpaired)."""
    from arpo_core.engines import TorchEngine
    from arpo_core.preference import dpo, kto, rft

    setup_torch(p)
    policy = load_policy(resolve_policy(policy_dir))
    trajs = read_trajectories(baseline_dir)
    kw = {"progress": True, "system": p.policy.system_prompt, "history_images": p.policy.history_images}
    if method == "rft":
        losses = rft(policy, trajs, p.rft, **kw)
        metrics = {"rft/loss_first": losses[0], "rft/loss_last": losses[-1], "rft/steps": float(len(losses))}
    elif method in ("dpo", "kto"):
        cfg = p.dpo if method == "dpo" else p.kto
        engine = TorchEngine(
            policy.model, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm
        )
        res = (dpo if method == "dpo" else kto)(policy, trajs, cfg, engine=engine, **kw)
        metrics = {
            k if k.startswith(f"{method}/") else f"{method}/{k}": float(v) for k, v in res.info.items()
        }
        metrics[f"{method}/examples"] = float(res.n_examples)
        if res.history:
            metrics.update({f"{method}/first/{k}": v for k, v in res.history[0].items()})
            metrics.update({f"{method}/last/{k}": v for k, v in res.history[-1].items()})
    else:
        raise ValueError(f"unknown offline method {method!r}; choose rft, dpo or kto")
    policy.save(out_dir)
    return metrics


STAGES = ("init_policy", "ground", "demos", "sft", "baseline", "select", "train", "evaluate")
