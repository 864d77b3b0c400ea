"""Multi-seed, multi-arm learning studies from the pipeline's own evaluations: is ARPO above GRPO?

A study is several runs of the train stage (arms x training seeds, e.g. DVC experiments), each
evaluating its policy during training on the same instances (`evaluate.during_training`,
pipeline/train.py, decision "Learning curves"). This module turns their stored evaluation episodes into the
numbers a learning claim needs; it reads trajectories and returns plain dicts (the CLI gathers the runs from
MLflow and writes the files).

Decisions:
- **Data-defined hard suite.** The hard suite is defined by the data, as the question asks: the in-domain
  tasks whose SAMPLED base success in the baseline stage's rollouts is at most `hard_max` (default 0.25:
  all-fail groups, the case replay exists for, are common there); the other trained tasks are controls. Only
  tasks the runs trained on count (a task whose per-task training metrics appear in their history): one the
  task selection dropped (no baseline success at all) gets no gradient of its own in any arm, so it would
  only dilute the comparison; it is reported apart, as `untrained_tasks` with each arm's success there.
  Runs with no per-task history (older ones) keep every evaluated task.
- **Late-training success.** An arm's success on a set of tasks: for each seed, the episode mean over the
  evaluations of the second half of training (epochs > half the last evaluated epoch) per task, averaged over
  tasks (every task weighs the same, as `evaluate.pooled_rate`), then the mean over seeds.
- **Two-level bootstrap.** ARPO minus GRPO is judged with a two-level bootstrap that includes seed-to-seed
  variance: each replicate draws the seeds of each arm with replacement AND the evaluation instances (task,
  episode index; shared by the two arms, so the comparison stays paired), then recomputes both arms' success
  as in decision "Late-training success". The 95% interval is the 2.5-97.5 percentiles. With n seeds per arm
  the interval cannot be narrower than the seed spread allows - a single seed gives an interval of instances
  only, and the result says so (`seeds`).
- **Full reporting.** Everything the claim needs is reported beside it: per arm, per task and per seed
  success; the base's success on the same instances; all-fail groups and replay fills from the training
  history; and (when targets are given) click alignment of every arm and of the base, and the image-blind
  ceiling (the best constant first click per task, `probe.blind_ceiling`) of the hard and control
  tasks, so a gain can be told apart from a better constant click.
- **Pinned-instance splits.** A study on pinned instances (the paper's protocol, suites.py,
  decision "Fixed instances"; `instance_effect`) is read by split: `train`, the pinned instances trained on
  (ids `family@...`: the paper's in-domain numbers), and `heldout`, fresh instances of the same families, both
  from the evaluations during training. Every arm trained on the same selected instances (one base, one
  baseline, one selection), so no task is dropped or split by difficulty here: the selection already kept the
  instances with a success.
- **Final evaluation success.** An arm's success per split is the final evaluation's (the trained policy, as
  the paper reports it), averaged over instances (every instance weighs the same) and over seeds; its 95%
  interval (`bootstrap_rate`) and every paired difference (`bootstrap_difference`,
  decision "Two-level bootstrap") resample seeds and instances. The base is paired on exactly the instances
  the arms played.
- **Per-instance replay activity.** Per training instance, all-fail groups and replay fills (the trainer's
  per-task counts, summed over epochs, averaged over the arm's seeds), beside the instance's sampled base
  success: where replay had something to do, and did it.
- **Compared arms.** The arms compared: ARPO and GRPO at the same group size (equal rollouts), ARPO with the
  buffer preloaded from the baseline, and the image-blind ARPO arm (`train.image_blind`): on the training
  instances it measures what memorising instructions alone reaches, so `arpo_minus_image_blind` is the
  share of the gain that needs the pixels.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arpo_core.analysis.evaluation import Scorer
from arpo_core.trajectory import Trajectory

__all__ = [
    "ArmRun",
    "arm_success",
    "bootstrap_difference",
    "bootstrap_rate",
    "eval_split",
    "hard_split",
    "instance_effect",
    "replay_effect",
    "second_half",
    "trained_tasks",
]

Instance = tuple[str, int]
"""(task_id, episode index): one evaluation instance (env seed first_seed + index)."""


@dataclass
class ArmRun:
    """One training run of a study arm."""

    arm: str
    """e.g. 'arpo_g4', 'grpo_g4', 'grpo_g16'."""
    seed: int
    """Its training seed (project.seed)."""
    evaluations: dict[int, list[Trajectory]]
    """Epoch -> greedy evaluation episodes of the policy at the end of that epoch."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The train stage's per-epoch metrics rows."""


def hard_split(
    baseline: Sequence[Trajectory], hard_max: float, score: Scorer
) -> tuple[list[str], list[str], dict]:
    """Decision "Data-defined hard suite": (hard task ids, control task ids, {task: sampled base success})."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for t in baseline:
        by_task[t.task_id].append(score(t))
    rates = {task: sum(v) / len(v) for task, v in sorted(by_task.items())}
    hard = [t for t, r in rates.items() if r <= hard_max]
    return hard, [t for t in rates if t not in hard], rates


def trained_tasks(runs: Sequence[ArmRun]) -> set[str] | None:
    """Decision "Data-defined hard suite": the task ids with training episodes in any run's history
    (`task/<domain>/<id>/episodes`), or None when no run logged per-task metrics."""
    found: set[str] = set()
    for r in runs:
        for row in r.history:
            for k, v in row.items():
                parts = k.split("/")
                if len(parts) == 4 and parts[0] == "task" and parts[3] == "episodes" and v:
                    found.add(parts[2])
    return found or None


def second_half(runs: Sequence[ArmRun]) -> list[int]:
    """Decision "Late-training success": the evaluated epochs after half of the last evaluated one (the last
    always in)."""
    epochs = sorted({e for r in runs for e in r.evaluations})
    if not epochs:
        return []
    return [e for e in epochs if e > epochs[-1] / 2]


def _outcomes(
    run: ArmRun, tasks: Sequence[str], epochs: Sequence[int], score: Scorer
) -> dict[Instance, float]:
    """Mean score per instance over the run's evaluations at `epochs`."""
    acc: dict[Instance, list[float]] = defaultdict(list)
    wanted = set(tasks)
    for e in epochs:
        for t in run.evaluations.get(e, []):
            if t.task_id in wanted:
                acc[(t.task_id, t.sample_idx)].append(score(t))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _task_mean(outcomes: Mapping[Instance, float], instances: Sequence[Instance]) -> float | None:
    by_task: dict[str, list[float]] = defaultdict(list)
    for inst in instances:
        if inst in outcomes:
            by_task[inst[0]].append(outcomes[inst])
    if not by_task:
        return None
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


def arm_success(
    runs: Sequence[ArmRun], tasks: Sequence[str], epochs: Sequence[int], score: Scorer
) -> dict[str, Any]:
    """Decision "Late-training success": {"success": mean over seeds, "seeds": {seed: success}, "tasks":
    {task: mean over seeds}}."""
    per_seed: dict[int, float] = {}
    per_task: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        out = _outcomes(r, tasks, epochs, score)
        s = _task_mean(out, list(out))
        if s is None:
            continue
        per_seed[r.seed] = s
        for task in tasks:
            v = [x for (t, _), x in out.items() if t == task]
            if v:
                per_task[task].append(sum(v) / len(v))
    success = sum(per_seed.values()) / len(per_seed) if per_seed else None
    return {
        "success": success,
        "seeds": per_seed,
        "n_seeds": len(per_seed),
        "tasks": {t: sum(v) / len(v) for t, v in per_task.items()},
    }


def bootstrap_difference(
    a: Sequence[ArmRun],
    b: Sequence[ArmRun],
    tasks: Sequence[str],
    epochs: Sequence[int],
    score: Scorer,
    reps: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Decision "Two-level bootstrap": success(a) - success(b) with a 95% interval over seeds and
    instances."""
    oa = [_outcomes(r, tasks, epochs, score) for r in a]
    ob = [_outcomes(r, tasks, epochs, score) for r in b]
    oa, ob = [o for o in oa if o], [o for o in ob if o]
    if not oa or not ob:
        return {"mean": None, "ci95": None, "reps": 0}
    instances = sorted(set().union(*oa, *ob))

    def diff(sa: Sequence[dict], sb: Sequence[dict], inst: Sequence[Instance]) -> float | None:
        ma = [m for m in (_task_mean(o, inst) for o in sa) if m is not None]
        mb = [m for m in (_task_mean(o, inst) for o in sb) if m is not None]
        if not ma or not mb:
            return None
        return sum(ma) / len(ma) - sum(mb) / len(mb)

    point = diff(oa, ob, instances)
    rng = random.Random(seed)
    draws = []
    for _ in range(reps):
        sa = [rng.choice(oa) for _ in oa]
        sb = [rng.choice(ob) for _ in ob]
        inst = [rng.choice(instances) for _ in instances]
        d = diff(sa, sb, inst)
        if d is not None:
            draws.append(d)
    draws.sort()
    lo, hi = draws[int(0.025 * (len(draws) - 1))], draws[int(0.975 * (len(draws) - 1))]
    return {"mean": point, "ci95": [lo, hi], "reps": len(draws), "seeds": [len(oa), len(ob)]}


def _history_counts(runs: Sequence[ArmRun], tasks: Sequence[str]) -> dict[str, Any]:
    """All-fail groups and replay fills summed over each run's epochs (per task where logged); the replay
    buffer's own counters are running totals, so their last value."""
    out: dict[str, Any] = {}
    for r in runs:
        total: dict[str, float] = defaultdict(float)
        for row in r.history:
            for k, v in row.items():
                if not isinstance(v, int | float):
                    continue
                if k in ("replay/groups_filled", "replay/groups_failed"):  # the buffer's running totals
                    total[k] = max(total[k], float(v))
                elif k in ("replay/all_fail_groups", "train/replayed"):  # per epoch
                    total[k] += float(v)
                for task in tasks:
                    for what in ("all_fail_groups", "replay_fills"):
                        if k.endswith(f"/{task}/{what}") and k.startswith("task/"):
                            total[f"{task}/{what}"] += float(v)
        out[str(r.seed)] = dict(total)
    return out


def _default_arm(arms: Mapping[str, Any], method: str, group: str | None) -> str | None:
    """The `method` arm with group size `group`, else the one with the smallest group size."""
    names = [a for a in arms if re.fullmatch(rf"{method}_g\d+", a)]  # not the _preload / _blind arms
    same = [a for a in names if a.split("_g")[-1] == group]
    if same:
        return same[0]
    sizes = sorted(names, key=lambda a: int(a.split("_g")[-1]) if a.split("_g")[-1].isdigit() else 1 << 30)
    return sizes[0] if sizes else None


def replay_effect(
    runs: Sequence[ArmRun],
    baseline: Sequence[Trajectory],
    base_eval: Sequence[Trajectory],
    *,
    score: Scorer,
    arpo: str | None = None,
    grpo: str | None = None,
    hard_max: float = 0.25,
    reps: int = 2000,
    targets: Sequence[Any] = (),
    first_seed: int = 0,
) -> dict[str, Any]:
    """The study's result document (decisions "Data-defined hard suite", "Late-training success",
    "Two-level bootstrap" and "Full reporting"). `arpo` / `grpo` name the two arms compared; by default the
    ARPO arm with the smallest group size and the GRPO arm with the same group size (equal rollouts per group:
    ARPO G=4 vs GRPO G=4 when the study also has GRPO G=16)."""
    hard, control, base_rates = hard_split(baseline, hard_max, score)
    trained = trained_tasks(runs)
    untrained = [t for t in hard + control if trained is not None and t not in trained]
    hard, control = [t for t in hard if t not in untrained], [t for t in control if t not in untrained]
    epochs = second_half(runs)
    arms: dict[str, list[ArmRun]] = defaultdict(list)
    for r in runs:
        arms[r.arm].append(r)
    base_run = ArmRun("base", 0, {0: list(base_eval)})
    arpo = arpo or _default_arm(arms, "arpo", None)
    grpo = grpo or _default_arm(arms, "grpo", arpo.split("_g")[-1] if arpo else None)
    doc: dict[str, Any] = {
        "hard_tasks": hard,
        "control_tasks": control,
        "untrained_tasks": untrained,
        "baseline_sampled_success": base_rates,
        "hard_max": hard_max,
        "epochs_averaged": epochs,
        "base": {
            "hard": arm_success([base_run], hard, [0], score)["success"],
            "control": arm_success([base_run], control, [0], score)["success"],
            "untrained": arm_success([base_run], untrained, [0], score)["success"],
            "tasks": arm_success([base_run], hard + control + untrained, [0], score)["tasks"],
        },
        "arms": {},
    }
    for name, rs in sorted(arms.items()):
        hard_s, ctrl_s = arm_success(rs, hard, epochs, score), arm_success(rs, control, epochs, score)
        untr_s = arm_success(rs, untrained, epochs, score)
        entry = {
            "hard": hard_s["success"],
            "control": ctrl_s["success"],
            "untrained": untr_s["success"],
            "seeds": hard_s["n_seeds"],
            "per_seed": {"hard": hard_s["seeds"], "control": ctrl_s["seeds"]},
            "tasks": {**hard_s["tasks"], **ctrl_s["tasks"], **untr_s["tasks"]},
            "curve": {
                str(e): arm_success(rs, hard, [e], score)["success"]
                for e in sorted({e for r in rs for e in r.evaluations})
            },
            "counts": _history_counts(rs, hard + control),
        }
        if targets:
            from arpo_core.analysis.probe import click_alignment

            last = max(epochs) if epochs else None
            trajs = [t for r in rs for t in r.evaluations.get(last, [])]
            entry["click_alignment"] = (
                click_alignment(trajs, targets, first_seed)["pooled"] if trajs else None
            )
        doc["arms"][name] = entry
    if targets:
        from arpo_core.analysis.probe import blind_ceiling, click_alignment

        doc["base"]["click_alignment"] = click_alignment(base_eval, targets, first_seed)["pooled"]
        ceilings = {
            split: blind_ceiling([r for r in targets if r.task_id in wanted])
            for split, wanted in (("hard", set(hard)), ("control", set(control)))
        }
        doc["image_blind"] = {
            **{split: c.get("_mean") for split, c in ceilings.items()},
            "tasks": {
                t: v["hit_rate"] for c in ceilings.values() for t, v in c.items() if not t.startswith("_")
            },
        }
    for key, name in (("arpo", arpo), ("grpo", grpo)):
        a = doc["arms"].get(name or "", {})
        doc[key] = {
            "arm": name,
            "hard": a.get("hard"),
            "control": a.get("control"),
            "seeds": a.get("seeds", 0),
        }
    doc["arpo_minus_grpo"] = {
        "hard": bootstrap_difference(
            arms.get(arpo or "", []), arms.get(grpo or "", []), hard, epochs, score, reps
        ),
        "control": bootstrap_difference(
            arms.get(arpo or "", []), arms.get(grpo or "", []), control, epochs, score, reps
        ),
    }
    for key, name in (("arpo_minus_base", arpo), ("grpo_minus_base", grpo)):
        rs = arms.get(name or "", [])  # none: bootstrap_difference returns mean None
        doc[key] = {
            split: bootstrap_difference(rs, [base_run], tasks, [*epochs, 0], score, reps)
            for split, tasks in (("hard", hard), ("control", control))
        }
    return doc


# --------------------------------------------------------------------------------------------------
# The paper's protocol: pinned instances (decisions "Pinned-instance splits", "Final evaluation success",
# "Per-instance replay activity" and "Compared arms")


def eval_split(task_id: str) -> str:
    """Decision "Pinned-instance splits": 'train' for a pinned instance (`family@...`), 'heldout' for a
    family's fresh instance."""
    return "train" if "@" in task_id else "heldout"


def _split_tasks(trajs: Sequence[Trajectory], split: str) -> list[str]:
    return sorted({t.task_id for t in trajs if eval_split(t.task_id) == split})


def bootstrap_rate(
    runs: Sequence[ArmRun],
    tasks: Sequence[str],
    epochs: Sequence[int],
    score: Scorer,
    reps: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Decision "Final evaluation success": an arm's success (decision "Late-training success"'s mean over
    seeds of the task-mean) with a 95% interval that resamples the seeds and the instances (task, episode
    index)."""
    outs = [o for o in (_outcomes(r, tasks, epochs, score) for r in runs) if o]
    if not outs:
        return {"mean": None, "ci95": None, "seeds": 0}
    instances = sorted(set().union(*outs))

    def rate(sample: Sequence[dict], inst: Sequence[Instance]) -> float | None:
        ms = [m for m in (_task_mean(o, inst) for o in sample) if m is not None]
        return sum(ms) / len(ms) if ms else None

    point = rate(outs, instances)
    rng = random.Random(seed)
    draws = sorted(
        d
        for d in (
            rate([rng.choice(outs) for _ in outs], [rng.choice(instances) for _ in instances])
            for _ in range(reps)
        )
        if d is not None
    )
    ci = [draws[int(0.025 * (len(draws) - 1))], draws[int(0.975 * (len(draws) - 1))]] if draws else None
    return {"mean": point, "ci95": ci, "seeds": len(outs), "instances": len(instances)}


def _instance_counts(runs: Sequence[ArmRun], names: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Decision "Per-instance replay activity": per training instance, all-fail groups and replay fills summed
    over the epochs of a run, then averaged over the arm's seeds; `names` maps metric-key task names back to
    task ids."""
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in runs:
        for row in r.history:
            for k, v in row.items():
                parts = k.split("/")
                counted = (
                    len(parts) == 4 and parts[0] == "task" and parts[3] in ("all_fail_groups", "replay_fills")
                )
                if counted and isinstance(v, int | float):
                    acc[names.get(parts[2], parts[2])][parts[3]] += float(v) / max(1, len(runs))
    return {t: dict(c) for t, c in sorted(acc.items())}


def instance_effect(
    runs: Sequence[ArmRun],
    baseline: Sequence[Trajectory],
    base_eval: Sequence[Trajectory],
    *,
    score: Scorer,
    group_size: int | None = None,
    reps: int = 2000,
) -> dict[str, Any]:
    """The result document of a study on pinned instances (decisions "Pinned-instance splits",
    "Final evaluation success", "Per-instance replay activity" and "Compared arms"): per arm and split success
    with 95% intervals over seeds and instances, paired differences, learning curves on the training
    instances, all-fail / filled counts per instance. Arms are named by `tracking/study_runs.py`: `arpo_g8`,
    `grpo_g8`, `arpo_g8_preload`, `arpo_g8_blind` (the image-blind control)."""
    from arpo_core.analysis.evaluation import _clean

    arms: dict[str, list[ArmRun]] = defaultdict(list)
    for r in runs:
        arms[r.arm].append(r)
    if group_size is None:
        sizes = sorted({int(a.split("_g")[1].split("_")[0]) for a in arms if a.startswith("arpo_g")})
        group_size = sizes[0] if sizes else None
    g = f"_g{group_size}"
    names = {
        "arpo": f"arpo{g}",
        "grpo": f"grpo{g}",
        "arpo_preload": f"arpo{g}_preload",
        "image_blind": f"arpo{g}_blind",
    }
    last = max((e for r in runs for e in r.evaluations), default=None)
    epochs = [last] if last is not None else []
    evaluated = [t for r in runs for t in r.evaluations.get(last, [])] if last is not None else []
    splits = {s: _split_tasks(evaluated, s) for s in ("train", "heldout")}
    # the base's episodes on exactly the instances the arms were evaluated on (its evaluate run also has
    # out-of-domain tasks, and more held-out instances than the evaluations during training play)
    wanted = {(t.task_id, t.sample_idx) for t in evaluated}
    base_run = ArmRun("base", 0, {0: [t for t in base_eval if (t.task_id, t.sample_idx) in wanted]})
    by_instance: dict[str, list[float]] = defaultdict(list)
    for t in baseline:
        by_instance[t.task_id].append(score(t))
    sampled = {k: sum(v) / len(v) for k, v in sorted(by_instance.items())}
    trained = set(splits["train"])
    doc: dict[str, Any] = {
        "protocol": "instances",
        "group_size": group_size,
        "epoch_evaluated": last,
        "splits": {s: len(ts) for s, ts in splits.items()},
        "train_instances": splits["train"],
        "heldout_tasks": splits["heldout"],
        "baseline_sampled_success": {k: v for k, v in sampled.items() if k in trained},
        "base": {s: bootstrap_rate([base_run], ts, [0], score, reps)["mean"] for s, ts in splits.items()},
        "base_ci95": {
            s: bootstrap_rate([base_run], ts, [0], score, reps)["ci95"] for s, ts in splits.items()
        },
        "arms": {},
    }
    key_names = {_clean(t): t for t in sampled} | {_clean(t): t for t in splits["train"]}
    for name, rs in sorted(arms.items()):
        entry: dict[str, Any] = {"seeds": len(rs)}
        for s, ts in splits.items():
            b = bootstrap_rate(rs, ts, epochs, score, reps)
            entry[s] = b["mean"]
            entry[f"{s}_ci95"] = b["ci95"]
            entry[f"{s}_per_seed"] = {
                str(r.seed): _task_mean(o, list(o))
                for r in rs
                for o in [_outcomes(r, ts, epochs, score)]
                if o
            }
        entry["curve"] = {
            s: {
                str(e): arm_success(rs, ts, [e], score)["success"]
                for e in sorted({e for r in rs for e in r.evaluations})
            }
            for s, ts in splits.items()
        }
        entry["counts"] = _instance_counts(rs, key_names)
        entry["groups_filled"] = sum(c.get("replay_fills", 0.0) for c in entry["counts"].values())
        entry["all_fail_groups"] = sum(c.get("all_fail_groups", 0.0) for c in entry["counts"].values())
        doc["arms"][name] = entry
    for key, arm in names.items():
        a = doc["arms"].get(arm)
        doc[key] = (
            {"arm": arm, "seeds": a["seeds"] if a else 0}
            | {s: (a or {}).get(s) for s in splits}
            | {f"{s}_ci95": (a or {}).get(f"{s}_ci95") for s in splits}
        )

    def diff(a: str, b: str | None) -> dict[str, Any]:
        ra = arms.get(names.get(a, a), [])
        rb = [base_run] if b is None else arms.get(names[b], [])
        return {
            s: bootstrap_difference(ra, rb, ts, [*epochs, 0] if b is None else epochs, score, reps)
            for s, ts in splits.items()
        }

    doc["arpo_minus_grpo"] = diff("arpo", "grpo")
    doc["arpo_preload_minus_grpo"] = diff("arpo_preload", "grpo")
    doc["arpo_preload_minus_arpo"] = diff("arpo_preload", "arpo")
    doc["arpo_minus_image_blind"] = diff("arpo", "image_blind")
    for key in ("arpo", "grpo", "arpo_preload", "image_blind"):
        doc[f"{key}_minus_base"] = diff(key, None)
    return doc
