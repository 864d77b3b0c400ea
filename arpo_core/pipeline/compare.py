"""Stage `compare`: the paper's comparison table (docs/method.md §4) from the evaluations every policy
shares - base, the offline baselines (rft, dpo, kto) and the trained policy (arpo or grpo) - with 95%
intervals, paired differences against the base, the image-blind ceiling and click alignment.

Decisions:
- **Stored episodes.** Numbers come from the stored evaluation episodes (greedy), not from other stages'
  metric files: `evaluate.summarize` per method and split (stratified 95% intervals),
  `probe.paired_difference` against the reference policy (`compare.reference`, default the base) on the same
  (task, instance) episodes, per split.
- **Image-blind ceiling.** The image-blind ceiling (docs/method.md §7): the best constant first click per
  task, from the DOM targets of exactly the evaluation instances (env seeds `evaluate.seed + k`), in-sample
  and two-fold cross-validated (`probe.blind_ceiling`), unless `compare.image_blind` is false. It needs a
  browser (the targets are read from the DOM after a reset) and a click oracle; tasks whose oracle does not
  open with a click (typing, keys) have no ceiling and are listed. For a single-click task the first-click
  ceiling bounds success; for a multi-step task it bounds only the first step.
- **Click alignment.** Click alignment (`probe.click_alignment`): how each method's first clicks follow the
  targets (within-task correlation), so a gain can be told apart from a better constant click.
- **Untrained methods listed.** A method whose stage recorded no training (offline_baselines.py,
  decision "Skipped baselines") is listed as not trained, with the reason; a method without episodes is left
  out of the table, never shown as 0.
- **Comparison outputs.** Outputs: `comparison.md`, `comparison.json` and `comparison.png` in the stage's
  output directory; the metrics are the headline rates and paired deltas (`compare/<method>/<split>/...`).
- **Trained-task view.** Where learning is measurable: the train stage trains only the tasks the selection
  kept, and only `tasks_per_iteration` of them per iteration, so a change on the whole in-domain suite is
  diluted by tasks that got no training rollout at all. Each method therefore also gets a `trained` cell: the
  in-domain tasks with at least one rollout in the train stage's stored trajectories (task ids read
  from `models/arpo/trajectories`, without the screenshots), with its rate, interval and paired delta
  against the reference on those tasks' shared instances. No training rollouts (or none stored): no cell.
  A suite of pinned instances needs no such cell: its `train` split is exactly the instances trained on.
- **Evaluation splits.** Splits are the evaluation's (common.py `evaluation_tasks`), in the order train,
  in_domain, heldout, out_of_domain. The image-blind ceiling of a split of task families is
  decision "Image-blind ceiling"'s; of the `train` split (pinned instances) it is the best constant first
  click per task FAMILY over its pinned instances (one reset each): a policy that ignores both the screen and
  the instruction. A policy that reads the instruction but not the screen can memorise every training
  instance, which no ceiling bounds: that is what the image-blind control arm (`train.image_blind`) measures.
  Click alignment is computed on the family splits (their instances are `evaluate.seed + k`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arpo_core.analysis.evaluation import Scorer, split_map, summarize
from arpo_core.config import Params
from arpo_core.envs.base import TaskSpec
from arpo_core.infra.fileio import atomic_open, atomic_write_json, atomic_write_text
from arpo_core.pipeline.common import TRAIN_SPLIT, evaluation_tasks, training_tasks
from arpo_core.pipeline.offline_baselines import METHODS, SKIPPED
from arpo_core.pipeline.policies import method_name
from arpo_core.pipeline.stage import SUITES, TASK_DATA, Stage
from arpo_core.trajectory import Trajectory, read_trajectories

__all__ = [
    "ORDER",
    "collect_evaluations",
    "first_click_targets",
    "headline",
    "run",
    "tracked_params",
    "trained_task_keys",
]

ORDER = ("base", "rft", "dpo", "kto", "grpo", "arpo", "grpo_blind", "arpo_blind")
SPLIT_ORDER = ("train", "in_domain", "heldout", "out_of_domain")
"""Decision "Evaluation splits": the order splits are shown in (any other split after these, by name)."""
LABELS = {"train": "training instances", "in_domain": "in-domain", "heldout": "held-out instances"}


def _label(split: str) -> str:
    return LABELS.get(split, split.replace("_", "-"))


def split_order(splits: Sequence[str]) -> list[str]:
    """Decision "Evaluation splits": the splits present, SPLIT_ORDER first."""
    present = set(splits)
    return [s for s in SPLIT_ORDER if s in present] + sorted(present - set(SPLIT_ORDER))


def tracked_params(p: Params) -> dict[str, str]:
    """The trained arm whose paired delta is the headline (`arpo` / `grpo`), a param of the run."""
    return {"method": method_name(p)}


def headline(p: Params, metrics: dict[str, float]) -> dict[str, float]:
    """The metric a user compares first (flows/runner.py, decision "Headline metric first"): the trained arm's
    paired delta against the reference on the first split (the training instances of a pinned suite, else
    in-domain), as `_delta_vs_<reference>` (`_delta_vs_base`)."""
    ref = p.compare.reference
    for split in ("train", "in_domain"):
        key = f"compare/{method_name(p)}/{split}/delta_vs_{ref}"
        if key in metrics:
            return {f"_delta_vs_{ref}": metrics[key]}
    return {}


def collect_evaluations(eval_dirs: Sequence[str | os.PathLike]) -> dict[str, list[Trajectory]]:
    """{method: greedy episodes} from `<dir>/<method>.parquet` files, in ORDER then by name."""
    found: dict[str, list[Trajectory]] = {}
    for d in map(Path, eval_dirs):
        for f in sorted(d.glob("*.parquet")) if d.is_dir() else []:
            if f.stem.endswith("-sampled"):
                # not the greedy evaluation (evaluate.py, decision "Trajectory files and keys")
                continue
            if f.stem in found:
                raise ValueError(f"two evaluations of {f.stem!r} (second: {f})")
            found[f.stem] = read_trajectories(f)
    rank = {m: i for i, m in enumerate(ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def trained_task_keys(train_dir: str | os.PathLike | None) -> set[tuple[str, str]]:
    """Decision "Trained-task view": (domain, task_id) of every task with a rollout in the train stage's
    trajectories."""
    import pyarrow.parquet as pq

    d = Path(train_dir) / "trajectories" if train_dir is not None else None
    keys: set[tuple[str, str]] = set()
    for f in sorted(d.glob("*.parquet")) if d is not None and d.is_dir() else []:
        t = pq.read_table(f, columns=["task_domain", "task_id"])
        keys |= set(zip(t.column("task_domain").to_pylist(), t.column("task_id").to_pylist(), strict=True))
    return keys


def first_click_targets(
    p: Params, tasks: Sequence[TaskSpec], episodes: int | None = None
) -> tuple[list[Any], dict[str, str]]:
    """Decision "Image-blind ceiling": DOM targets of the first `episodes` (default
    `evaluate.episodes_per_task`) evaluation instances per task, and {task: why it has none}."""
    from arpo_core.analysis.probe import first_step_targets
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv
    from arpo_core.envs.miniwob.oracles import ORACLES

    e = p.evaluate
    seeds = range(e.seed, e.seed + (episodes or e.episodes_per_task))
    pinned = [t for t in tasks if t.pinned]
    tasks = [t for t in tasks if not t.pinned]
    records: list[Any] = []
    missing: dict[str, str] = {}
    miniwob = [t for t in tasks if t.backend == "miniwob"]
    for t in tasks:
        if t.backend != "miniwob":
            missing[t.task_id] = f"{t.backend} task: no DOM targets"
        elif t.task_id not in ORACLES:
            missing[t.task_id] = "no oracle"
    todo = [(t, seeds) for t in miniwob if t.task_id in ORACLES]
    # decision "Evaluation splits": one reset an instance
    todo += [(t, [t.seed]) for t in pinned if t.family in ORACLES]
    missing |= {t.family: "no oracle" for t in pinned if t.family not in ORACLES}
    if not todo:
        return records, missing
    env = MiniWoBEnv(episode_time_limit_s=p.env.episode_time_limit_s)
    try:
        for t, task_seeds in todo:
            try:
                records += first_step_targets(env, [t], task_seeds)
            except ValueError as err:  # the oracle's first action is not a click
                missing[t.family] = str(err)
    finally:
        env.close()
    return records, missing


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _interval(ci: Sequence[float] | None) -> str:
    return "-" if not ci else f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def _vs(vs: dict[str, Any] | None) -> str:
    """A paired difference as '+2.2 [-1.0, +5.5]' (points), '-' without one."""
    return "-" if not vs or vs["delta"] is None else f"{100 * vs['delta']:+.1f} {_interval(vs['ci95'])}"


def _plot(doc: dict[str, Any], path: Path) -> None:
    """Success per method and split with 95% intervals; the first split's blind ceiling as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = list(doc["methods"])
    fig = Figure(figsize=(1.4 + 1.1 * len(methods), 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    splits = doc["splits"]
    width = 0.8 / max(1, len(splits))
    colours = ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c")
    for j, split in enumerate(splits):
        colour = colours[j % len(colours)]
        xs, ys, err = [], [], [[], []]
        for i, m in enumerate(methods):
            cell = doc["methods"][m][split]
            if cell["success"] is None:
                continue
            xs.append(i + (j - (len(splits) - 1) / 2) * width)
            ys.append(100 * cell["success"])
            err[0].append(100 * (cell["success"] - cell["ci95"][0]))
            err[1].append(100 * (cell["ci95"][1] - cell["success"]))
        ax.bar(xs, ys, width, yerr=err, capsize=3, color=colour, label=_label(split))
    blind = doc["image_blind"].get(splits[0]) if splits else None
    if blind is not None:
        ax.axhline(
            100 * blind,
            color="#444444",
            linestyle="--",
            linewidth=1,
            label=f"image-blind ({_label(splits[0])})",
        )
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("greedy success (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _markdown(doc: dict[str, Any], p: Params) -> str:
    e = p.evaluate
    splits = doc["splits"]
    ref = doc["reference"]
    instances = "a pinned instance plays one greedy episode of itself; " if "train" in splits else ""
    lines = [
        "# Comparison",
        "",
        f"Greedy success (%) with 95% intervals; {instances}a task family plays {e.episodes_per_task} "
        f"instances on env seeds {e.seed}..{e.seed + e.episodes_per_task - 1}; the same instances for every "
        f"method. Paired delta: the method minus {ref}, episode by episode on the shared instances (95% "
        "interval).",
        "",
        "| method | "
        + " | ".join(f"{_label(s)} | 95% CI | vs {ref}" for s in splits)
        + " | click/target corr |",
        "|---|" + "---|---|---|" * len(splits) + "---|",
    ]
    for m, row in doc["methods"].items():
        cells = [m]
        for split in splits:
            c = row[split]
            cells += [_pct(c["success"]), _interval(c["ci95"]).replace("+", ""), _vs(c.get("vs_reference"))]
        corr = row["click_alignment"]["pooled"].get("click_target_corr") if row["click_alignment"] else None
        cells.append("-" if corr is None else f"{corr:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    ib = doc["image_blind"]
    trained_rows = []
    for m, row in doc["methods"].items():
        c = row.get("trained")
        if c:
            trained_rows.append(
                f"| {m} | {_pct(c['success'])} | {_interval(c['ci95']).replace('+', '')} | "
                f"{_vs(c.get('vs_reference'))} | {c['episodes']} |"
            )
    lines.append(
        "| image-blind first click | "
        + " | ".join(f"{_pct(ib.get(s))} | cv {_pct(ib.get(f'{s}_cv'))} | -" for s in splits)
        + " | - |"
    )
    lines += [
        "",
        "Image-blind first click: the hit rate of the best constant first click per task (in-sample; cv: "
        "two-fold cross-validated), averaged over tasks with a click oracle. It bounds success only on tasks "
        "decided by one click; on multi-step tasks it bounds the first step alone.",
    ]
    if "train" in splits:
        lines += [
            "On the training instances it is the best constant click per task family over its instances: a "
            "policy that reads the instruction but not the screen can still memorise each instance, which "
            "the image-blind control arm (`train.image_blind`) measures.",
        ]
    lines += ["", "![comparison](comparison.png)", ""]
    if trained_rows:
        n_in = len(doc["methods"][ref]["in_domain"].get("tasks") or {})
        lines += [
            f"## Where training reached ({len(doc['trained_tasks'])} of {n_in} in-domain tasks)",
            "",
            "The train stage rolled out only these tasks (the selection's, `train.tasks_per_iteration` per "
            "iteration): "
            + ", ".join(doc["trained_tasks"])
            + ". On the other in-domain tasks a change can only "
            "be a side effect, so this is where a gain from training is measurable.",
            "",
            f"| method | success | 95% CI | vs {ref} | episodes |",
            "|---|---|---|---|---|",
            *trained_rows,
            "",
        ]
    if ib["no_ceiling"]:
        lines.append(
            "No image-blind ceiling (mean over the other tasks): " + ", ".join(sorted(ib["no_ceiling"])) + "."
        )
    for m, why in doc["not_trained"].items():
        lines.append(f"- {m}: not trained ({why}).")
    return "\n".join(lines) + "\n"


def _trained_cell(
    trajs: Sequence[Trajectory],
    base: Sequence[Trajectory] | None,
    trained: Sequence[TaskSpec],
    score: Scorer,
) -> dict[str, Any]:
    """Decision "Trained-task view": rate, interval and paired delta on the in-domain tasks training
    reached."""
    from arpo_core.analysis.probe import paired_difference

    ids = {t.key for t in trained}
    mine = [t for t in trajs if t.key in ids]
    stats = summarize(
        mine,
        {k: "trained" for k in ids},
        scoring=score.rule,
        max_steps=score.max_steps,
        prefix="m",
        per_task=False,
    )
    cell: dict[str, Any] = {
        "success": stats.get("m/trained/success_rate"),
        "ci95": [stats["m/trained/success_ci_low"], stats["m/trained/success_ci_high"]] if mine else None,
        "episodes": len(mine),
    }
    if base is not None and mine:
        cell["vs_reference"] = paired_difference([t for t in base if t.key in ids], mine, score)
    return cell


def _family_records(records: Sequence[Any]) -> list[Any]:
    """Decision "Evaluation splits": pinned instances' target records under their family's name (one constant
    click per family over its instances)."""
    from dataclasses import replace

    return [replace(r, task_id=r.task_id.split("@", 1)[0]) for r in records]


def run(
    p: Params,
    eval_dirs: Sequence[str | os.PathLike],
    offline_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    train_dir: str | os.PathLike | None = None,
    selected_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The comparison report (decision "Comparison outputs") from the evaluation episodes in `eval_dirs`."""
    from arpo_core.analysis.probe import blind_ceiling, click_alignment, paired_difference

    out_dir = Path(out_dir)
    evals = collect_evaluations(eval_dirs)
    ref = p.compare.reference
    if ref not in evals:
        raise FileNotFoundError(
            f"compare: no evaluation of compare.reference={ref!r} ({ref}.parquet) in {list(map(str, eval_dirs))}; "
            f"evaluated: {', '.join(evals) or 'none'}"
        )
    every = evaluation_tasks(p, training_tasks(p, selected_path))
    splits = split_map(every)
    order = split_order(list(splits.values()))
    tasks = {s: [t for t in every if t.split == s] for s in order}
    records, no_ceiling = first_click_targets(p, every) if p.compare.image_blind else ([], {})
    pinned_ids = {t.task_id for t in every if t.pinned}
    family_records = [r for r in records if r.task_id not in pinned_ids]
    e = p.evaluate
    score = Scorer.of(
        e.osworld_hard, e.max_steps
    )  # every rate and paired delta scores episodes as the evaluation did
    reached = trained_task_keys(train_dir)
    trained = [] if TRAIN_SPLIT in tasks else [t for t in tasks.get("in_domain", []) if t.key in reached]
    doc: dict[str, Any] = {
        "episodes_per_task": e.episodes_per_task,
        "first_seed": e.seed,
        "reference": ref,
        "splits": order,
        "trained_tasks": [t.task_id for t in trained],
        "methods": {},
    }
    metrics: dict[str, float] = {}
    base = evals[ref]
    for m, trajs in evals.items():
        stats = summarize(
            trajs, splits, scoring=score.rule, max_steps=score.max_steps, prefix="m", per_task=True
        )
        row: dict[str, Any] = {}
        for split in order:
            ids = {t.key for t in tasks[split]}
            mine = [t for t in trajs if t.key in ids]
            rate = stats.get(f"m/{split}/success_rate")
            cell: dict[str, Any] = {
                "success": rate,
                "ci95": [stats[f"m/{split}/success_ci_low"], stats[f"m/{split}/success_ci_high"]]
                if mine
                else None,
                "episodes": len(mine),
                "format_error_rate": stats.get(f"m/{split}/format_error_rate"),
                "tasks": {
                    t.task_id: stats[f"m/task/{t.domain}/{_key(t.task_id)}/success_rate"]
                    for t in tasks[split]
                    if f"m/task/{t.domain}/{_key(t.task_id)}/success_rate" in stats
                },
            }
            if m != ref and mine:
                cell["vs_reference"] = paired_difference([t for t in base if t.key in ids], mine, score)
                if cell["vs_reference"]["delta"] is not None:
                    metrics[f"compare/{m}/{split}/delta_vs_{ref}"] = cell["vs_reference"]["delta"]
            if rate is not None:
                metrics[f"compare/{m}/{split}/success_rate"] = rate
            row[split] = cell
        if trained:
            row["trained"] = _trained_cell(trajs, base if m != ref else None, trained, score)
            vs = row["trained"].get("vs_reference")
            if row["trained"]["success"] is not None:
                metrics[f"compare/{m}/trained/success_rate"] = row["trained"]["success"]
            if vs and vs["delta"] is not None:
                metrics[f"compare/{m}/trained/delta_vs_{ref}"] = vs["delta"]
        row["click_alignment"] = click_alignment(trajs, family_records, e.seed) if family_records else None
        doc["methods"][m] = row
    ceiling = {}
    for s in order:
        keys = {t.key for t in tasks[s]}
        mine = [r for r in records if (r.task_domain, r.task_id) in keys]
        ceiling[s] = blind_ceiling(_family_records(mine) if s == TRAIN_SPLIT else mine)
    doc["image_blind"] = {
        **{s: ceiling[s].get("_mean", {}).get("hit_rate") for s in order},
        **{f"{s}_cv": ceiling[s].get("_mean", {}).get("cv_hit_rate") for s in order},
        "tasks": {s: {t: v for t, v in ceiling[s].items() if not t.startswith("_")} for s in order},
        "no_ceiling": no_ceiling,
    }
    for s in order:
        if doc["image_blind"][s] is not None:
            metrics[f"compare/image_blind/{s}"] = doc["image_blind"][s]
    doc["not_trained"] = {}
    for d in map(Path, offline_dirs):
        if (d / SKIPPED).exists():
            info = json.loads((d / SKIPPED).read_text())
            doc["not_trained"][info["method"]] = info["reason"]
    atomic_write_json(out_dir / "comparison.json", doc, indent=1, sort_keys=False)
    atomic_write_text(out_dir / "comparison.md", _markdown(doc, p))
    _plot(doc, out_dir / "comparison.png")
    metrics["compare/methods"] = float(len(evals))
    return metrics


def _key(task_id: str) -> str:
    """A task id as evaluate.summarize writes it into metric keys (MLflow's alphabet)."""
    from arpo_core.analysis.evaluation import _clean

    return _clean(task_id)


STAGE = Stage(
    "compare",
    run=run,
    params=("compare", "evaluate", "train.use_selection", *SUITES),
    inputs={
        "eval_dirs": ("data/eval", *(f"data/eval_{m}" for m in METHODS)),
        "offline_dirs": tuple(f"models/{m}" for m in METHODS),
        "train_dir": "models/arpo",
        "selected_path": "data/selected_tasks.json",
    },
    outputs={"out_dir": "reports/comparison"},
    artifacts={"reports/comparison": "report"},
    data=TASK_DATA,
    envs=True,
    viewer=False,
    headline=headline,
    tracked_params=tracked_params,
)
