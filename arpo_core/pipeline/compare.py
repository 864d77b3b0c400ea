"""Stage `compare`: the paper's comparison table (docs/method.md §4) from the evaluations every policy
shares - base, the offline baselines (rft, dpo, kto) and the trained policy (arpo or grpo) - with 95%
intervals, paired differences against the base, the image-blind ceiling and click alignment.

Decisions:
1. Numbers come from the stored evaluation episodes (greedy), not from other stages' metric files:
   `evaluate.summarize` per method and split (stratified 95% intervals), `probe.paired_difference`
   against the reference policy (`compare.reference`, default the base) on the same (task, instance)
   episodes, per split.
2. The image-blind ceiling (docs/method.md §7): the best constant first click per task, from the DOM
   targets of exactly the evaluation instances (env seeds `evaluate.seed + k`), in-sample and two-fold
   cross-validated (`probe.blind_ceiling`), unless `compare.image_blind` is false. It needs a browser (the targets are read from the DOM after
   a reset) and a click oracle; tasks whose oracle does not open with a click (typing, keys) have no
   ceiling and are listed. For a single-click task the first-click ceiling bounds success; for a
   multi-step task it bounds only the first step.
3. Click alignment (`probe.click_alignment`): how each method's first clicks follow the targets
   (within-task correlation), so a gain can be told apart from a better constant click.
4. A method whose stage recorded no training (offline decision 3) is listed as not trained, with the
   reason; a method without episodes is left out of the table, never shown as 0.
5. Outputs: `comparison.md`, `comparison.json` and `comparison.png` in the stage's output directory;
   the metrics are the headline rates and paired deltas (`compare/<method>/<split>/...`).
6. Where learning is measurable: the train stage trains only the tasks the selection kept, and only
   `tasks_per_iteration` of them per iteration, so a change on the whole in-domain suite is diluted by
   tasks that got no training rollout at all. Each method therefore also gets a `trained` cell: the
   in-domain tasks with at least one rollout in the train stage's stored trajectories (task ids read
   from `models/arpo/trajectories`, without the screenshots), with its rate, interval and paired delta
   against the reference on those tasks' shared instances. No training rollouts (or none stored): no cell.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arpo_core.config import Params
from arpo_core.envs.base import TaskSpec
from arpo_core.evaluate import split_map, summarize
from arpo_core.fileio import atomic_open, atomic_write_json, atomic_write_text
from arpo_core.pipeline.common import method_name, suite_tasks
from arpo_core.pipeline.offline import SKIPPED
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

ORDER = ("base", "rft", "dpo", "kto", "grpo", "arpo")
SPLITS = ("in_domain", "out_of_domain")


def tracked_params(p: Params) -> dict[str, str]:
    """The trained arm whose paired delta is the headline (`arpo` / `grpo`), a param of the run."""
    return {"method": method_name(p)}


def headline(p: Params, metrics: dict[str, float]) -> dict[str, float]:
    """The metric a user compares first (flows/runner.py decision 11): the trained arm's in-domain paired
    delta against the reference, as `_delta_vs_<reference>` (`_delta_vs_base`)."""
    ref = p.compare.reference
    key = f"compare/{method_name(p)}/in_domain/delta_vs_{ref}"
    return {f"_delta_vs_{ref}": metrics[key]} if key in metrics else {}


def collect_evaluations(eval_dirs: Sequence[str | os.PathLike]) -> dict[str, list[Trajectory]]:
    """{method: greedy episodes} from `<dir>/<method>.parquet` files, in ORDER then by name."""
    found: dict[str, list[Trajectory]] = {}
    for d in map(Path, eval_dirs):
        for f in sorted(d.glob("*.parquet")) if d.is_dir() else []:
            if f.stem.endswith("-sampled"):  # not the greedy evaluation (evaluate decision 2)
                continue
            if f.stem in found:
                raise ValueError(f"two evaluations of {f.stem!r} (second: {f})")
            found[f.stem] = read_trajectories(f)
    rank = {m: i for i, m in enumerate(ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def trained_task_keys(train_dir: str | os.PathLike | None) -> set[tuple[str, str]]:
    """Decision 6: (domain, task_id) of every task with a rollout in the train stage's trajectories."""
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
    """Decision 2: DOM targets of the first `episodes` (default `evaluate.episodes_per_task`) evaluation
    instances per task, and {task: why it has none}."""
    from arpo_core.envs.miniwob import MiniWoBEnv
    from arpo_core.envs.oracles import ORACLES
    from arpo_core.probe import first_step_targets

    e = p.evaluate
    seeds = range(e.seed, e.seed + (episodes or e.episodes_per_task))
    records: list[Any] = []
    missing: dict[str, str] = {}
    miniwob = [t for t in tasks if t.backend == "miniwob"]
    for t in tasks:
        if t.backend != "miniwob":
            missing[t.task_id] = f"{t.backend} task: no DOM targets"
        elif t.task_id not in ORACLES:
            missing[t.task_id] = "no oracle"
    todo = [t for t in miniwob if t.task_id in ORACLES]
    if not todo:
        return records, missing
    env = MiniWoBEnv(episode_time_limit_s=p.env.episode_time_limit_s)
    try:
        for t in todo:
            try:
                records += first_step_targets(env, [t], seeds)
            except ValueError as err:  # the oracle's first action is not a click
                missing[t.task_id] = str(err)
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
    """Success per method and split with 95% intervals; the in-domain blind ceiling as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = list(doc["methods"])
    fig = Figure(figsize=(1.4 + 1.1 * len(methods), 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.38
    for j, (split, colour) in enumerate(zip(SPLITS, ("#d62728", "#1f77b4"), strict=True)):
        xs, ys, err = [], [], [[], []]
        for i, m in enumerate(methods):
            cell = doc["methods"][m][split]
            if cell["success"] is None:
                continue
            xs.append(i + (j - 0.5) * width)
            ys.append(100 * cell["success"])
            err[0].append(100 * (cell["success"] - cell["ci95"][0]))
            err[1].append(100 * (cell["ci95"][1] - cell["success"]))
        ax.bar(xs, ys, width, yerr=err, capsize=3, color=colour, label=split.replace("_", "-"))
    blind = doc["image_blind"]["in_domain"]
    if blind is not None:
        ax.axhline(100 * blind, color="#444444", linestyle="--", linewidth=1, label="image-blind (in-domain)")
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("greedy success (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _markdown(doc: dict[str, Any], p: Params) -> str:
    e = p.evaluate
    lines = [
        "# Comparison",
        "",
        f"Greedy success (%) with 95% intervals; {e.episodes_per_task} episodes per task on env seeds "
        f"{e.seed}..{e.seed + e.episodes_per_task - 1}, the same instances for every method. "
        f"Paired delta: the method minus {doc['reference']}, episode by episode on the shared instances "
        "(95% interval).",
        "",
        f"| method | in-domain | 95% CI | vs {doc['reference']} | out-of-domain | 95% CI | vs {doc['reference']} "
        "| click/target corr |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, row in doc["methods"].items():
        cells = [m]
        for split in SPLITS:
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
        f"| image-blind first click | {_pct(ib['in_domain'])} | cv {_pct(ib['in_domain_cv'])} | - | "
        f"{_pct(ib['out_of_domain'])} | cv {_pct(ib['out_of_domain_cv'])} | - | - |"
    )
    lines += [
        "",
        "Image-blind first click: the hit rate of the best constant first click per task (in-sample; cv: "
        "two-fold cross-validated), averaged over tasks with a click oracle. It bounds success only on tasks "
        "decided by one click; on multi-step tasks it bounds the first step alone.",
        "",
        "![comparison](comparison.png)",
        "",
    ]
    if trained_rows:
        n_in = len(doc["methods"][doc["reference"]]["in_domain"].get("tasks") or {})
        lines += [
            f"## Where training reached ({len(doc['trained_tasks'])} of {n_in} in-domain tasks)",
            "",
            "The train stage rolled out only these tasks (the selection's, `train.tasks_per_iteration` per "
            "iteration): "
            + ", ".join(doc["trained_tasks"])
            + ". On the other in-domain tasks a change can only "
            "be a side effect, so this is where a gain from training is measurable.",
            "",
            f"| method | success | 95% CI | vs {doc['reference']} | episodes |",
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
    max_steps: int,
) -> dict[str, Any]:
    """Decision 6: rate, interval and paired delta on the in-domain tasks training reached."""
    from arpo_core.probe import paired_difference

    ids = {t.key for t in trained}
    mine = [t for t in trajs if t.key in ids]
    stats = summarize(mine, {k: "trained" for k in ids}, max_steps=max_steps, prefix="m", per_task=False)
    cell: dict[str, Any] = {
        "success": stats.get("m/trained/success_rate"),
        "ci95": [stats["m/trained/success_ci_low"], stats["m/trained/success_ci_high"]] if mine else None,
        "episodes": len(mine),
    }
    if base is not None and mine:
        cell["vs_reference"] = paired_difference([t for t in base if t.key in ids], mine)
    return cell


def run(
    p: Params,
    eval_dirs: Sequence[str | os.PathLike],
    offline_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    train_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The comparison report (decision 5) from the evaluation episodes in `eval_dirs`."""
    from arpo_core.probe import blind_ceiling, click_alignment, paired_difference

    out_dir = Path(out_dir)
    evals = collect_evaluations(eval_dirs)
    ref = p.compare.reference
    if ref not in evals:
        raise FileNotFoundError(
            f"compare: no evaluation of compare.reference={ref!r} ({ref}.parquet) in {list(map(str, eval_dirs))}; "
            f"evaluated: {', '.join(evals) or 'none'}"
        )
    tasks = {s: suite_tasks(p, s) for s in SPLITS}
    splits = split_map(tasks["in_domain"] + tasks["out_of_domain"])
    every = tasks["in_domain"] + tasks["out_of_domain"]
    records, no_ceiling = first_click_targets(p, every) if p.compare.image_blind else ([], {})
    e = p.evaluate
    reached = trained_task_keys(train_dir)
    trained = [t for t in tasks["in_domain"] if t.key in reached]
    doc: dict[str, Any] = {
        "episodes_per_task": e.episodes_per_task,
        "first_seed": e.seed,
        "reference": ref,
        "trained_tasks": [t.task_id for t in trained],
        "methods": {},
    }
    metrics: dict[str, float] = {}
    base = evals[ref]
    for m, trajs in evals.items():
        stats = summarize(trajs, splits, max_steps=e.max_steps, prefix="m", per_task=True)
        row: dict[str, Any] = {}
        for split in SPLITS:
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
                    t.task_id: stats[f"m/task/{t.domain}/{t.task_id}/success_rate"]
                    for t in tasks[split]
                    if f"m/task/{t.domain}/{t.task_id}/success_rate" in stats
                },
            }
            if m != ref and mine:
                cell["vs_reference"] = paired_difference([t for t in base if t.key in ids], mine)
                if cell["vs_reference"]["delta"] is not None:
                    metrics[f"compare/{m}/{split}/delta_vs_{ref}"] = cell["vs_reference"]["delta"]
            if rate is not None:
                metrics[f"compare/{m}/{split}/success_rate"] = rate
            row[split] = cell
        if trained:
            row["trained"] = _trained_cell(trajs, base if m != ref else None, trained, e.max_steps)
            vs = row["trained"].get("vs_reference")
            if row["trained"]["success"] is not None:
                metrics[f"compare/{m}/trained/success_rate"] = row["trained"]["success"]
            if vs and vs["delta"] is not None:
                metrics[f"compare/{m}/trained/delta_vs_{ref}"] = vs["delta"]
        row["click_alignment"] = click_alignment(trajs, records, e.seed) if records else None
        doc["methods"][m] = row
    ceiling = {
        s: blind_ceiling([r for r in records if (r.task_domain, r.task_id) in {t.key for t in tasks[s]}])
        for s in SPLITS
    }
    doc["image_blind"] = {
        "in_domain": ceiling["in_domain"].get("_mean", {}).get("hit_rate"),
        "in_domain_cv": ceiling["in_domain"].get("_mean", {}).get("cv_hit_rate"),
        "out_of_domain": ceiling["out_of_domain"].get("_mean", {}).get("hit_rate"),
        "out_of_domain_cv": ceiling["out_of_domain"].get("_mean", {}).get("cv_hit_rate"),
        "tasks": {t: v for c in ceiling.values() for t, v in c.items() if not t.startswith("_")},
        "no_ceiling": no_ceiling,
    }
    for s in SPLITS:
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
