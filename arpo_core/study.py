"""Multi-seed, multi-arm learning studies from the pipeline's own evaluations: is ARPO above GRPO?

A study is several runs of the train stage (arms x training seeds, e.g. DVC experiments), each
evaluating its policy during training on the same instances (`evaluate.during_training`,
pipeline/train.py decision 4). This module turns their stored evaluation episodes into the numbers a
learning claim needs; it reads trajectories and returns plain dicts (the CLI gathers the runs from
MLflow and writes the files).

Decisions:
1. The hard suite is defined by the data, as the question asks: the in-domain tasks whose SAMPLED base
   success in the baseline stage's rollouts is at most `hard_max` (default 0.25: all-fail groups, the
   case replay exists for, are common there); the other trained tasks are controls. Only tasks the runs
   trained on count (a task whose per-task training metrics appear in their history): one the task
   selection dropped (no baseline success at all) gets no gradient of its own in any arm, so it would
   only dilute the comparison; it is reported apart, as `untrained_tasks` with each arm's success there.
   Runs with no per-task history (older ones) keep every evaluated task.
2. An arm's success on a set of tasks: for each seed, the episode mean over the evaluations of the
   second half of training (epochs > half the last evaluated epoch) per task, averaged over tasks (every
   task weighs the same, as `evaluate.pooled_rate`), then the mean over seeds.
3. ARPO minus GRPO is judged with a two-level bootstrap that includes seed-to-seed variance: each
   replicate draws the seeds of each arm with replacement AND the evaluation instances (task, episode
   index; shared by the two arms, so the comparison stays paired), then recomputes both arms' success
   as in decision 2. The 95% interval is the 2.5-97.5 percentiles. With n seeds per arm the interval
   cannot be narrower than the seed spread allows - a single seed gives an interval of instances only,
   and the result says so (`seeds`).
4. Everything the claim needs is reported beside it: per arm, per task and per seed success; the
   base's success on the same instances; all-fail groups and replay fills from the training history;
   and (when targets are given) click alignment of every arm and of the base, and the image-blind
   ceiling (the best constant first click per task, `probe.blind_ceiling`) of the hard and control
   tasks, so a gain can be told apart from a better constant click.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arpo_core.evaluate import episode_score
from arpo_core.trajectory import Trajectory

__all__ = [
    "ArmRun",
    "arm_success",
    "bootstrap_difference",
    "hard_split",
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


def hard_split(baseline: Sequence[Trajectory], hard_max: float = 0.25) -> tuple[list[str], list[str], dict]:
    """Decision 1: (hard task ids, control task ids, {task: sampled base success})."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for t in baseline:
        by_task[t.task_id].append(episode_score(t))
    rates = {task: sum(v) / len(v) for task, v in sorted(by_task.items())}
    hard = [t for t, r in rates.items() if r <= hard_max]
    return hard, [t for t in rates if t not in hard], rates


def trained_tasks(runs: Sequence[ArmRun]) -> set[str] | None:
    """Decision 1: the task ids with training episodes in any run's history (`task/<domain>/<id>/episodes`),
    or None when no run logged per-task metrics."""
    found: set[str] = set()
    for r in runs:
        for row in r.history:
            for k, v in row.items():
                parts = k.split("/")
                if len(parts) == 4 and parts[0] == "task" and parts[3] == "episodes" and v:
                    found.add(parts[2])
    return found or None


def second_half(runs: Sequence[ArmRun]) -> list[int]:
    """Decision 2: the evaluated epochs after half of the last evaluated one (the last always in)."""
    epochs = sorted({e for r in runs for e in r.evaluations})
    if not epochs:
        return []
    return [e for e in epochs if e > epochs[-1] / 2]


def _outcomes(run: ArmRun, tasks: Sequence[str], epochs: Sequence[int]) -> dict[Instance, float]:
    """Mean score per instance over the run's evaluations at `epochs`."""
    acc: dict[Instance, list[float]] = defaultdict(list)
    wanted = set(tasks)
    for e in epochs:
        for t in run.evaluations.get(e, []):
            if t.task_id in wanted:
                acc[(t.task_id, t.sample_idx)].append(episode_score(t))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def _task_mean(outcomes: Mapping[Instance, float], instances: Sequence[Instance]) -> float | None:
    by_task: dict[str, list[float]] = defaultdict(list)
    for inst in instances:
        if inst in outcomes:
            by_task[inst[0]].append(outcomes[inst])
    if not by_task:
        return None
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


def arm_success(runs: Sequence[ArmRun], tasks: Sequence[str], epochs: Sequence[int]) -> dict[str, Any]:
    """Decision 2: {"success": mean over seeds, "seeds": {seed: success}, "tasks": {task: mean over seeds}}."""
    per_seed: dict[int, float] = {}
    per_task: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        out = _outcomes(r, tasks, epochs)
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
    reps: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Decision 3: success(a) - success(b) with a 95% interval over seeds and instances."""
    oa = [_outcomes(r, tasks, epochs) for r in a]
    ob = [_outcomes(r, tasks, epochs) for r in b]
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
    names = [a for a in arms if a.startswith(f"{method}_g")]
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
    arpo: str | None = None,
    grpo: str | None = None,
    hard_max: float = 0.25,
    reps: int = 2000,
    targets: Sequence[Any] = (),
    first_seed: int = 0,
) -> dict[str, Any]:
    """The study's result document (decisions 1-4). `arpo` / `grpo` name the two arms compared; by default
    the ARPO arm with the smallest group size and the GRPO arm with the same group size (equal rollouts
    per group: ARPO G=4 vs GRPO G=4 when the study also has GRPO G=16)."""
    hard, control, base_rates = hard_split(baseline, hard_max)
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
            "hard": arm_success([base_run], hard, [0])["success"],
            "control": arm_success([base_run], control, [0])["success"],
            "untrained": arm_success([base_run], untrained, [0])["success"],
            "tasks": arm_success([base_run], hard + control + untrained, [0])["tasks"],
        },
        "arms": {},
    }
    for name, rs in sorted(arms.items()):
        hard_s, ctrl_s = arm_success(rs, hard, epochs), arm_success(rs, control, epochs)
        untr_s = arm_success(rs, untrained, epochs)
        entry = {
            "hard": hard_s["success"],
            "control": ctrl_s["success"],
            "untrained": untr_s["success"],
            "seeds": hard_s["n_seeds"],
            "per_seed": {"hard": hard_s["seeds"], "control": ctrl_s["seeds"]},
            "tasks": {**hard_s["tasks"], **ctrl_s["tasks"], **untr_s["tasks"]},
            "curve": {
                str(e): arm_success(rs, hard, [e])["success"]
                for e in sorted({e for r in rs for e in r.evaluations})
            },
            "counts": _history_counts(rs, hard + control),
        }
        if targets:
            from arpo_core.probe import click_alignment

            last = max(epochs) if epochs else None
            trajs = [t for r in rs for t in r.evaluations.get(last, [])]
            entry["click_alignment"] = (
                click_alignment(trajs, targets, first_seed)["pooled"] if trajs else None
            )
        doc["arms"][name] = entry
    if targets:
        from arpo_core.probe import blind_ceiling, click_alignment

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
        "hard": bootstrap_difference(arms.get(arpo or "", []), arms.get(grpo or "", []), hard, epochs, reps),
        "control": bootstrap_difference(
            arms.get(arpo or "", []), arms.get(grpo or "", []), control, epochs, reps
        ),
    }
    for key, name in (("arpo_minus_base", arpo), ("grpo_minus_base", grpo)):
        rs = arms.get(name or "", [])  # none: bootstrap_difference returns mean None
        doc[key] = {
            split: bootstrap_difference(rs, [base_run], tasks, [*epochs, 0], reps)
            for split, tasks in (("hard", hard), ("control", control))
        }
    return doc
