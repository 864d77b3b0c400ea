"""Probes of what a policy's clicks follow: DOM targets of seeded MiniWoB episodes, the image-blind
ceiling, and how evaluation clicks line up with the targets (docs/method.md §7, issues #4 and #5).

A success rate alone does not show perception: on the single-step click tasks a constant click per
task reaches 29% (docs/method.md §7). These measures put a number beside every success rate.

Decisions:
- **Oracle targets.** Targets come from the DOM oracles (`envs.oracles.oracle_step`), not from a second copy
  of their rules: the target element is the one the oracle's first click lands in. Among the visible elements
  containing that point (smaller than half the screen, which drops <body> and layout wrappers), the
  largest whose centre is the click point (within 0.5 px) wins - the oracle clicks centres, and a
  button is larger than the icon centred inside it; when none is centred (the oracle's `free_point`
  moved the click off a covered centre) the smallest element containing the point wins.
- **Screen pixels.** Everything is in SCREEN pixels (the env's 160x210 task area): the oracle's actions and
  the stored evaluation actions (`Trajectory` steps hold `to_screen`-mapped actions, so `evaluate.first_click`
  is already in screen pixels). Boxes are (x0, y0, x1, y1), the format `grounding.best_constant_click`
  takes; it does not care about the frame as long as boxes and clicks share it.
- **Episode pairing.** Episodes are paired by (task_id, env seed). `evaluate.eval_jobs` gives episode k of
  every task the env seed `first_seed + k` and stores k as the trajectory's `sample_idx`, so seed = first_seed
  + sample_idx. MiniWoB single-step tasks are deterministic given `reset(seed)` (tested), and every
  pairing is checked by the utterance: a trajectory whose instruction differs from its record's is
  counted as `unpaired` and left out, so a wrong seed convention shows up as a number, not as noise.
- **Hit rule.** A click is a hit when it lies inside the target box (edges included, like
  `best_constant_click`). Episodes without a first-step click (parse error, key action) count as misses in the
  hit rate and are left out of correlations and spread (`clicks` says how many had one).
- **Within-task correlation.** The pooled `click_target_corr` is WITHIN-task: clicks and targets are centred
  on their per-task means before one Pearson correlation over all episodes, per axis, and the two axes are
  averaged. A raw pooled correlation would reward the image-blind failure itself: a constant click per task,
  placed near each task's typical target, correlates with targets across tasks while ignoring the
  screen. Within-task pooling gives that policy 0. The raw pooled value is reported beside it.
- **Constant Pearson zero.** Pearson of a constant sequence is 0 (`grounding.pearson`): a constant click
  "does not follow".
- **Cross-validated ceiling.** The ceiling is the best point for the very instances it is scored on
  (in-sample), so with few episodes it is biased upwards (with 10 instances a point can be fitted to most of
  them). Beside it, `cv_hit_rate` is two-fold cross-validated: the point fitted on half of the instances,
  scored on the other half. The in-sample value is the conservative bar for "above the blind ceiling".
- **Paired comparison.** Two evaluations of the same instances are compared PAIRED (`paired_difference`):
  episode by episode on (task_id, sample_idx) - the same env seed by decision "Episode pairing" - with the
  utterance checked. The interval of the difference is the normal one on the per-episode differences (each in
  [-1, 1]), and the exact two-sided sign test (McNemar) on the discordant episodes gives the p-value. Pairing
  removes the instance-difficulty variance that two independent intervals carry, so a 5-point change on 300
  episodes can be told from noise when the two evaluations disagree on few instances.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from arpo_core.analysis.evaluation import Scorer, click_spread, first_click
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.dom import SCREEN_SIZE, DomElement
from arpo_core.offline.grounding import best_constant_click, pearson
from arpo_core.trajectory import Trajectory

__all__ = [
    "TargetRecord",
    "blind_ceiling",
    "click_alignment",
    "cv_ceiling",
    "first_step_targets",
    "paired_difference",
    "target_element",
    "within_corr",
]

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class TargetRecord:
    """The first click's target of one seeded episode, in screen pixels."""

    task_domain: str
    task_id: str
    seed: int
    utterance: str
    box: Box
    """(x0, y0, x1, y1) of the target element."""
    centre: tuple[float, float]
    oracle_point: tuple[float, float]
    """Where the oracle clicks (the centre unless something overlaps it, oracles.free_point)."""
    tag: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.seed)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TargetRecord:
        return cls(
            task_domain=str(d["task_domain"]),
            task_id=str(d["task_id"]),
            seed=int(d["seed"]),
            utterance=str(d["utterance"]),
            box=tuple(float(v) for v in d["box"]),  # type: ignore[arg-type]
            centre=(float(d["centre"][0]), float(d["centre"][1])),
            oracle_point=(float(d["oracle_point"][0]), float(d["oracle_point"][1])),
            tag=str(d["tag"]),
        )


def _contains(box: Box, p: tuple[float, float]) -> bool:
    return box[0] <= p[0] <= box[2] and box[1] <= p[1] <= box[3]


def _edges(e: DomElement) -> Box:
    left, top, w, h = e.bbox
    return (left, top, left + w, top + h)


def target_element(
    dom: Sequence[DomElement], point: tuple[float, float], screen: tuple[int, int] = SCREEN_SIZE
) -> DomElement:
    """The element a click at `point` targets (decision "Oracle targets"); ValueError when no element contains
    it."""
    max_area = screen[0] * screen[1] / 2
    cands = [
        e
        for e in dom
        if e.visible
        and e.bbox[2] * e.bbox[3] > 0
        and e.bbox[2] * e.bbox[3] < max_area
        and _contains(_edges(e), point)
    ]
    if not cands:
        raise ValueError(f"no visible element contains the click {point}")
    centred = [e for e in cands if math.dist(e.center, point) <= 0.5]
    if centred:
        return max(centred, key=lambda e: e.bbox[2] * e.bbox[3])
    return min(cands, key=lambda e: e.bbox[2] * e.bbox[3])


def first_step_targets(env: Any, tasks: Sequence[TaskSpec], seeds: Iterable[int]) -> list[TargetRecord]:
    """Reset `env` (a `MiniWoBEnv`) on every (task, seed) and record the oracle's first click target.

    Tasks without an oracle or whose oracle's first action has no point raise ValueError: the probe
    is defined for click tasks only.
    """
    from arpo_core.envs.miniwob.oracles import oracle_step

    seeds = list(seeds)
    out: list[TargetRecord] = []
    for task in tasks:
        for seed in seeds:
            obs = env.reset(task, seed=seed)
            dom = env.dom_elements()
            step = oracle_step(task.family, obs.instruction, dom)
            if step is None:
                raise ValueError(f"{task.task_id}: no DOM oracle, so no click target")
            point = next((a.point for a in step[1] if a.point is not None), None)
            if point is None:
                raise ValueError(f"{task.task_id} seed {seed}: the oracle's first action has no point")
            el = target_element(dom, point, tuple(obs.screen_size))
            box = _edges(el)
            out.append(
                TargetRecord(
                    task_domain=task.domain,
                    task_id=task.task_id,
                    seed=seed,
                    utterance=obs.instruction,
                    box=box,
                    centre=el.center,
                    oracle_point=(float(point[0]), float(point[1])),
                    tag=el.tag,
                )
            )
    return out


def _hits(point: tuple[float, float], boxes: Sequence[Box]) -> int:
    return sum(_contains(b, point) for b in boxes)


def cv_ceiling(boxes: Sequence[Box]) -> float | None:
    """Two-fold cross-validated constant-click hit rate: the best point of the even-indexed boxes
    scored on the odd ones and vice versa (decision "Cross-validated ceiling"); None with fewer than 2
    boxes."""
    if len(boxes) < 2:
        return None
    a, b = list(boxes[0::2]), list(boxes[1::2])
    hits = _hits(best_constant_click(a)[0], b) + _hits(best_constant_click(b)[0], a)
    return hits / len(boxes)


def blind_ceiling(records: Sequence[TargetRecord]) -> dict[str, dict[str, Any]]:
    """Per task: the best constant click and its hit rate over the task's records (the image-blind
    ceiling of docs/method.md §7) -> {task_id: {"point": [x, y], "hit_rate": r, "cv_hit_rate": r2,
    "n": n}}, plus "_mean" (the means of the per-task rates, how `evaluate.pooled_rate` pools
    success). `hit_rate` is in-sample, `cv_hit_rate` two-fold cross-validated
    (decision "Cross-validated ceiling")."""
    by_task: dict[str, list[Box]] = defaultdict(list)
    for r in records:
        by_task[r.task_id].append(r.box)
    out: dict[str, dict[str, Any]] = {}
    for task in sorted(by_task):
        point, rate = best_constant_click(by_task[task])
        cv = cv_ceiling(by_task[task])
        out[task] = {
            "point": [point[0], point[1]],
            "hit_rate": rate,
            "cv_hit_rate": cv,
            "n": len(by_task[task]),
        }
    if out:
        rates = [v["hit_rate"] for v in out.values()]
        cvs = [v["cv_hit_rate"] for v in out.values()]
        out["_mean"] = {
            "hit_rate": sum(rates) / len(rates),
            "cv_hit_rate": None if None in cvs else sum(cvs) / len(cvs),
            "n": sum(v["n"] for v in out.values()),
        }
    return out


def within_corr(groups: Sequence[tuple[Sequence[float], Sequence[float]]]) -> float | None:
    """Pearson correlation of (a, b) pooled over groups after centring each group on its own means
    (decision "Within-task correlation"); None with fewer than 2 points. Groups of one point contribute
    nothing (centred to 0).

    >>> within_corr([([0, 1], [5, 6]), ([10, 11], [0, 1])])
    1.0
    """
    a: list[float] = []
    b: list[float] = []
    for xs, ys in groups:
        if not xs:
            continue
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        a += [x - mx for x in xs]
        b += [y - my for y in ys]
    return pearson(a, b) if len(a) >= 2 else None


def _corr(a: Sequence[float], b: Sequence[float]) -> float | None:
    return pearson(a, b) if len(a) >= 2 else None


def _mean_or_none(*vals: float | None) -> float | None:
    vs = [v for v in vals if v is not None]
    return sum(vs) / len(vs) if len(vs) == len(vals) and vs else None


def click_alignment(
    trajectories: Sequence[Trajectory], records: Sequence[TargetRecord], first_seed: int
) -> dict[str, Any]:
    """How the first clicks of evaluation episodes line up with their targets (decisions "Screen pixels",
    "Episode pairing", "Hit rule", "Within-task correlation" and "Constant Pearson zero").

    Args:
        trajectories: evaluation episodes from `evaluate.evaluate_policy` (or the evaluate stage) run
            with env seed `first_seed`; tasks without records are ignored.
        records: `first_step_targets` output covering those (task, seed) pairs.
        first_seed: the evaluation's env seed (episode k ran seed first_seed + k).

    Returns:
        {"tasks": {task_id: {episodes, clicks, hit_rate, corr_x, corr_y, spread_px}},
         "pooled": {episodes, clicks, unpaired, hit_rate, corr_x, corr_y, click_target_corr,
                    raw_corr_x, raw_corr_y, spread_px}}; correlations are None with < 2 clicks.
    """
    recs = {r.key: r for r in records}
    pairs: dict[str, list[tuple[TargetRecord, tuple[float, float] | None]]] = defaultdict(list)
    unpaired = 0
    for t in trajectories:
        rec = recs.get((t.task_id, first_seed + t.sample_idx))
        if rec is None:
            if any(r.task_id == t.task_id for r in records):
                unpaired += 1
            continue
        if rec.utterance != t.instruction:
            unpaired += 1
            continue
        pairs[rec.task_id].append((rec, first_click(t)))

    tasks: dict[str, dict[str, Any]] = {}
    gx: list[tuple[list[float], list[float]]] = []
    gy: list[tuple[list[float], list[float]]] = []
    all_cx: list[float] = []
    all_cy: list[float] = []
    all_tx: list[float] = []
    all_ty: list[float] = []
    hits = episodes = clicks = 0
    spreads: list[float] = []
    for task in sorted(pairs):
        ps = pairs[task]
        clicked = [(r, c) for r, c in ps if c is not None]
        cx = [c[0] for _, c in clicked]
        cy = [c[1] for _, c in clicked]
        tx = [r.centre[0] for r, _ in clicked]
        ty = [r.centre[1] for r, _ in clicked]
        n_hit = sum(_contains(r.box, c) for r, c in clicked)
        spread = click_spread([c for _, c in clicked])
        tasks[task] = {
            "episodes": len(ps),
            "clicks": len(clicked),
            "hit_rate": n_hit / len(ps),
            "corr_x": _corr(cx, tx),
            "corr_y": _corr(cy, ty),
            "spread_px": spread,
        }
        gx.append((cx, tx))
        gy.append((cy, ty))
        all_cx += cx
        all_cy += cy
        all_tx += tx
        all_ty += ty
        hits += n_hit
        episodes += len(ps)
        clicks += len(clicked)
        if spread is not None:
            spreads.append(spread)
    corr_x, corr_y = within_corr(gx), within_corr(gy)
    pooled = {
        "episodes": episodes,
        "clicks": clicks,
        "unpaired": unpaired,
        "hit_rate": hits / episodes if episodes else None,
        "corr_x": corr_x,
        "corr_y": corr_y,
        "click_target_corr": _mean_or_none(corr_x, corr_y),
        "raw_corr_x": _corr(all_cx, all_tx),
        "raw_corr_y": _corr(all_cy, all_ty),
        "spread_px": sum(spreads) / len(spreads) if spreads else None,
    }
    return {"tasks": tasks, "pooled": pooled}


def _sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided binomial (p = 1/2) p-value of `wins` vs `losses` discordant pairs."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(
    before: Sequence[Trajectory], after: Sequence[Trajectory], score: Scorer
) -> dict[str, Any]:
    """`after` minus `before` on the episodes both evaluated (decision "Paired comparison"), each episode
    scored by `score` (the evaluation's rule and step limit, `Scorer.of(e.osworld_hard, e.max_steps)`).

    Returns n (paired episodes), unpaired (episodes in only one, or whose utterances differ), before,
    after, delta (mean per-episode difference of scores clipped to [0, 1]), ci95 of delta, wins (after
    succeeded where before failed, scores >= 0.5 vs < 0.5), losses, and sign_test_p.
    """

    def index(trajs: Sequence[Trajectory]) -> dict[tuple[str, str, int], Trajectory]:
        out: dict[tuple[str, str, int], Trajectory] = {}
        for t in trajs:
            key = (t.task_domain, t.task_id, t.sample_idx)
            if key in out:
                raise ValueError(f"two evaluation episodes share {key}: not one evaluation's trajectories")
            out[key] = t
        return out

    a, b = index(before), index(after)
    pairs = [(a[k], b[k]) for k in sorted(a.keys() & b.keys()) if a[k].instruction == b[k].instruction]
    unpaired = len(a.keys() | b.keys()) - len(pairs)
    n = len(pairs)
    if n == 0:
        return {
            "n": 0,
            "unpaired": unpaired,
            "before": None,
            "after": None,
            "delta": None,
            "ci95": None,
            "wins": 0,
            "losses": 0,
            "sign_test_p": 1.0,
        }
    d = [score(y) - score(x) for x, y in pairs]
    mean = sum(d) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    wins = sum(score(x) < 0.5 <= score(y) for x, y in pairs)
    losses = sum(score(y) < 0.5 <= score(x) for x, y in pairs)
    return {
        "n": n,
        "unpaired": unpaired,
        "before": sum(score(x) for x, _ in pairs) / n,
        "after": sum(score(y) for _, y in pairs) / n,
        "delta": mean,
        "ci95": [mean - half, mean + half],
        "wins": wins,
        "losses": losses,
        "sign_test_p": _sign_test_p(wins, losses),
    }
