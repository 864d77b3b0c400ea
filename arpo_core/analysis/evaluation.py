"""Evaluation: success rates by task / domain / split with 95% intervals, and running an evaluation.

Decisions:
- **Pure statistics.** Pure statistics first (`summarize`), on finished `Trajectory` objects plus a task ->
  split map, so the same numbers come out of a live evaluation, a stored Parquet file or the training
  rollouts. The output is a flat dict of floats with slash-namespaced keys (docs/design.md), the same in
  `metrics/*.json` and MLflow: `{prefix}/{split}/success_rate`, `{prefix}/domain/{domain}/...`,
  `{prefix}/task/{domain}/{task_id}/...` and `{prefix}/all/...`.
- **Trajectory score.** A trajectory's score is the checker's success in [0, 1] (OSWorld can give fractions;
  they count fractionally, as OSWorld's own average does). `scoring="osworld_hard"` replaces it by
  `rewards.osworld_hard`: 0 when the episode used all `max_steps` steps and its last action is FAIL.
  The rule and the step limit come from the evaluate section, always together (`Scorer.of`): no
  function here has a default for either, so the compare stage, the study and the probe score an
  episode as the evaluation did.
- **Wilson intervals.** Per task the interval is Wilson's score interval for a binomial proportion (k
  successes of n episodes): unlike the normal (Wald) interval it stays inside [0, 1] and does not collapse to
  zero width at 0/n or n/n, which is common with few episodes per task.
- **Pooled task means.** Pooled rates (domain, split, all) are the mean of the per-task rates (every task
  weighs the same, however many of its episodes finished; with equal counts this equals the episode mean).
  Episodes are NOT independent draws across tasks (tasks differ in difficulty), so a pooled Wilson interval on
  all episodes would be wrong. The question an evaluation answers is "how good is this policy on
  these tasks", with the task set fixed and shared by every method compared, so the interval is the
  stratified one: Var = sum_t Var_t / T^2, with each task's variance taken from its Agresti-Coull
  adjusted rate p~_t = (k_t + z^2/2) / (n_t + z^2), Var_t = p~_t (1 - p~_t) / (n_t + z^2), so a task at
  0/n or n/n still contributes uncertainty; the interval is rate +- z sqrt(Var), clipped to [0, 1].
  It does not cover sampling of new tasks (task-level variance); with T tasks that would be the
  between-task standard deviation / sqrt(T), much wider and not what a same-task comparison needs.
- **Paired evaluation seeds.** `evaluate_policy` builds its own jobs (not `make_group_jobs`): episode k of
  every task gets env seed `first_seed + k`, so N episodes of a task see N different instances, and every
  method evaluated with the same first seed sees the same instances (a paired comparison: less variance
  between methods). Choose a seed range disjoint from training's. How episodes are played (temperature - 0 is
  greedy -, step limit, sampling seed) is the caller's `RolloutConfig`, built from params like every
  rollout's.
- **Env faults excluded.** Jobs hit by env faults come back in `failed` and never count as policy failures;
  their number is reported as `{prefix}/all/failed_jobs`.
- **Click spread.** A success rate alone does not show whether the policy looks at the screen (docs/method.md
  §7: a constant click per task reached the image-blind ceiling). `click_spread_px` is an image-dependence
  measure: per task, the RMS distance (screen pixels) of the first step's first click from its mean
  over that task's episodes (needs >= 2 episodes with a click); pooled over tasks by the mean. Greedy
  clicks that never move across instances give 0.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from arpo_core.algorithm.rollout import EpisodeJob, RolloutConfig, run_episodes
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.pool import EnvPool
from arpo_core.rewards import osworld_hard
from arpo_core.trajectory import Trajectory

if TYPE_CHECKING:  # torch: the generator is passed in, never built here
    from arpo_core.policy.generate import Generator

__all__ = [
    "Z95",
    "EvalResult",
    "RateStats",
    "Scorer",
    "click_spread",
    "episode_score",
    "eval_jobs",
    "evaluate_policy",
    "first_click",
    "last_action_kind",
    "pooled_rate",
    "split_map",
    "summarize",
    "wilson_interval",
]

Z95 = 1.959963984540054
"""Two-sided 95% normal quantile."""

Scoring = Literal["standard", "osworld_hard"]


@dataclass(frozen=True)
class Scorer:
    """How one episode scores (decision "Trajectory score"): the rule and the step limit the episodes ran
    under."""

    rule: Scoring
    max_steps: int

    @classmethod
    def of(cls, osworld_hard: bool, max_steps: int) -> Scorer:
        """From the evaluate section's keys: `Scorer.of(e.osworld_hard, e.max_steps)` (the keys named at
        the call, so a stage's params walk sees exactly which it reads)."""
        return cls("osworld_hard" if osworld_hard else "standard", max_steps)

    def __call__(self, traj: Trajectory) -> float:
        return episode_score(traj, self.rule, self.max_steps)


_RESERVED_SPLITS = {"all", "domain", "task", "time"}  # other key components


def wilson_interval(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (k may be fractional: summed scores).

    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n) with p = k/n. n = 0 gives (0, 1).
    """
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class RateStats:
    """A success rate with its 95% interval and counts."""

    rate: float
    ci_low: float
    ci_high: float
    episodes: int
    tasks: int


def pooled_rate(per_task: Sequence[tuple[float, int]], z: float = Z95) -> RateStats:
    """Mean of per-task rates with the stratified Agresti-Coull interval (decision "Pooled task means").

    Args:
        per_task: (k_t, n_t) per task: summed scores and episodes; tasks with n_t = 0 are skipped.
    """
    cells = [(k, n) for k, n in per_task if n > 0]
    if not cells:
        return RateStats(0.0, 0.0, 1.0, 0, 0)
    T = len(cells)
    rate = sum(k / n for k, n in cells) / T
    var = 0.0
    for k, n in cells:
        p_adj = (k + z * z / 2) / (n + z * z)
        var += p_adj * (1 - p_adj) / (n + z * z)
    half = z * math.sqrt(var) / T
    return RateStats(rate, max(0.0, rate - half), min(1.0, rate + half), sum(n for _, n in cells), T)


def last_action_kind(traj: Trajectory) -> str | None:
    """Kind of the last action of the last step (`call_user`, `finished`, ...); None when the last
    reply did not parse or had no action."""
    if not traj.steps:
        return None
    actions = traj.steps[-1].actions()
    if not isinstance(actions, list) or not actions:
        return None  # a parse error stores {"parse_error": ...}
    kind = actions[-1].get("kind") if isinstance(actions[-1], dict) else None
    return kind if isinstance(kind, str) else None


def episode_score(traj: Trajectory, scoring: Scoring, max_steps: int) -> float:
    """The score one episode contributes to success rates (decision "Trajectory score")."""
    success = min(1.0, max(0.0, float(traj.success)))
    if scoring == "standard":
        return success
    if scoring == "osworld_hard":
        return osworld_hard(success, len(traj.steps) >= max_steps, last_action_kind(traj))
    raise ValueError(f"unknown scoring {scoring!r}; choose 'standard' or 'osworld_hard'")


def first_click(traj: Trajectory) -> tuple[float, float] | None:
    """Screen point of the first action with a point in the first step, or None."""
    if not traj.steps:
        return None
    actions = traj.steps[0].actions()
    for a in actions if isinstance(actions, list) else []:
        p = a.get("point") if isinstance(a, dict) else None
        if isinstance(p, (list, tuple)) and len(p) == 2:
            return (float(p[0]), float(p[1]))
    return None


def click_spread(points: Sequence[tuple[float, float]]) -> float | None:
    """RMS distance of points from their mean, sqrt(var_x + var_y) with ddof 0; None for < 2 points."""
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return math.sqrt(sum((x - mx) ** 2 + (y - my) ** 2 for x, y in points) / len(points))


def split_map(tasks: Sequence[TaskSpec]) -> dict[tuple[str, str], str]:
    """(domain, task_id) -> split, from suite TaskSpecs."""
    return {t.key: t.split for t in tasks}


_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")


def _clean(name: str) -> str:
    """MLflow metric keys allow alphanumerics, _ - . space and /: replace anything else by '_'."""
    return _KEY_CHARS.sub("_", name)


def _rate_metrics(
    prefix: str, stats: RateStats, trajs: Sequence[Trajectory], spreads: Sequence[float]
) -> dict[str, float]:
    n = max(1, len(trajs))
    spread = {f"{prefix}/click_spread_px": sum(spreads) / len(spreads)} if spreads else {}
    return spread | {
        f"{prefix}/success_rate": stats.rate,
        f"{prefix}/success_ci_low": stats.ci_low,
        f"{prefix}/success_ci_high": stats.ci_high,
        f"{prefix}/episodes": float(stats.episodes),
        f"{prefix}/tasks": float(stats.tasks),
        f"{prefix}/format_error_rate": sum(t.format_error for t in trajs) / n,
        f"{prefix}/mean_steps": sum(len(t.steps) for t in trajs) / n,
    }


def summarize(
    trajectories: Sequence[Trajectory],
    splits: Mapping[tuple[str, str], str],
    *,
    scoring: Scoring,
    max_steps: int,
    prefix: str = "eval",
    per_task: bool = True,
    z: float = Z95,
) -> dict[str, float]:
    """Success statistics of finished episodes (decisions "Pure statistics", "Trajectory score",
    "Wilson intervals" and "Pooled task means").

    Args:
        trajectories: evaluation episodes (any number per task).
        splits: (domain, task_id) -> split name ("in_domain", "out_of_domain", ...); every
            trajectory's task must be in it (a missing task is an error, not a silent "unknown").
        scoring: "standard" (checker success) or "osworld_hard" (decision "Trajectory score").
        max_steps: the episodes' step limit (for OSWorld-Hard's "hit the step limit").
        prefix: first key component, e.g. "eval" or "eval/greedy".
        per_task: also emit `{prefix}/task/{domain}/{task_id}/...` keys.

    Returns:
        A flat {key: float} dict: for each split, each domain and `all`: success_rate, success_ci_low,
        success_ci_high, episodes, tasks, format_error_rate, mean_steps and, where tasks have >= 2
        episodes with a first-step click, click_spread_px (decision "Click spread"); per task the same with
        the Wilson interval.
    """
    bad = _RESERVED_SPLITS & set(splits.values())
    if bad:
        raise ValueError(f"split names {sorted(bad)} collide with metric key components; rename them")
    by_task: dict[tuple[str, str], list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        if t.key not in splits:
            raise KeyError(f"task {t.task_domain}/{t.task_id} is not in the task -> split map")
        by_task[t.key].append(t)

    cells: dict[tuple[str, str], tuple[float, int]] = {}
    spreads: dict[tuple[str, str], list[float]] = {}
    out: dict[str, float] = {}
    for key in sorted(by_task):
        trajs = by_task[key]
        k = sum(episode_score(t, scoring, max_steps) for t in trajs)
        cells[key] = (k, len(trajs))
        spread = click_spread([p for p in map(first_click, trajs) if p is not None])
        spreads[key] = [] if spread is None else [spread]
        if per_task:
            lo, hi = wilson_interval(k, len(trajs), z)
            stats = RateStats(k / len(trajs), lo, hi, len(trajs), 1)
            name = f"{prefix}/task/{_clean(key[0])}/{_clean(key[1])}"
            out.update(_rate_metrics(name, stats, trajs, spreads[key]))

    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key in cells:
        groups[f"{prefix}/{_clean(splits[key])}"].append(key)
        groups[f"{prefix}/domain/{_clean(key[0])}"].append(key)
        groups[f"{prefix}/all"].append(key)
    for name in sorted(groups):
        keys = groups[name]
        stats = pooled_rate([cells[k] for k in keys], z)
        trajs = [t for k in keys for t in by_task[k]]
        out.update(_rate_metrics(name, stats, trajs, [s for k in keys for s in spreads[k]]))
    return out


# --------------------------------------------------------------------------------------------------
# Running an evaluation


@dataclass
class EvalResult:
    metrics: dict[str, float]
    """`summarize` output plus `{prefix}/all/failed_jobs` and the rollout's time/ and env-fault metrics."""
    trajectories: list[Trajectory]
    failed: list[tuple[EpisodeJob, str]]
    """(EpisodeJob, error) of jobs lost to env faults (decision "Env faults excluded")."""


def eval_jobs(
    tasks: Sequence[TaskSpec], episodes_per_task: int, seed: int, instance_episodes: int = 1
) -> list[EpisodeJob]:
    """Episode k of every task runs env seed `seed + k` (decision "Paired evaluation seeds"); a pinned
    instance (suites.py, decision "Fixed instances") plays `instance_episodes` episodes of itself; group_id =
    task index."""
    if episodes_per_task < 1 or instance_episodes < 1:
        raise ValueError("episodes_per_task and instance_episodes must be >= 1")
    return [
        EpisodeJob(task, seed=seed + k, group_id=g, sample_idx=k)
        for g, task in enumerate(tasks)
        for k in range(instance_episodes if task.pinned else episodes_per_task)
    ]


def _kept_rollout_metric(key: str) -> bool:
    """The rollout metrics an evaluation passes on under its prefix: timings and env faults (every
    kind, and per task), so faults during evaluation are counted like those during training."""
    return (
        key.startswith(("time/", "rollout/faults/"))
        or key == "rollout/env_faults"
        or (key.startswith("task/") and key.endswith("/env_faults"))
    )


def evaluate_policy(
    pool: EnvPool,
    generator: Generator,
    tasks: Sequence[TaskSpec],
    episodes_per_task: int,
    rollout: RolloutConfig,
    *,
    first_seed: int,
    scoring: Scoring,
    prefix: str = "eval",
    run_id: str = "",
    stage: str = "evaluate",
    epoch: int = 0,
    policy_version: int = 0,
    progress=None,
    instance_episodes: int = 1,
) -> EvalResult:
    """Run `episodes_per_task` episodes of every task (`instance_episodes` of a pinned instance) and
    summarise them.

    Args:
        pool: an `EnvPool` (or anything with its submit_* API).
        generator: the policy's `Generator`.
        rollout: how episodes are played: temperature (0 = greedy), max_steps, pixels, coordinate
            mode, format penalty, sampling seed.
        first_seed: env seed of every task's first episode (decision "Paired evaluation seeds").
        scoring, prefix: see `summarize`.
    """
    jobs = eval_jobs(tasks, episodes_per_task, first_seed, instance_episodes)
    res = run_episodes(
        pool,
        generator,
        jobs,
        rollout,
        run_id=run_id,
        stage=stage,
        epoch=epoch,
        policy_version=policy_version,
        progress=progress,
    )
    metrics = summarize(
        res.trajectories, split_map(tasks), scoring=scoring, max_steps=rollout.max_steps, prefix=prefix
    )
    metrics[f"{prefix}/all/failed_jobs"] = float(len(res.failed))
    metrics.update({f"{prefix}/{k}": v for k, v in res.metrics.items() if _kept_rollout_metric(k)})
    return EvalResult(metrics, list(res.trajectories), list(res.failed))
