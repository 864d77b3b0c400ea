"""`arpo study`: the result files of a multi-seed study, gathered from the project's MLflow experiment.

The runs themselves go through the front doors (DVC experiments or Prefect deployments, one per arm and
seed, with `evaluate.during_training > 0`; docs/orchestration.md "A replay study"); this module only
reads what they logged and writes `replay_effect.json`, a Markdown summary and a plot.

Decisions:
- **Study runs.** A study's runs are the FINISHED `train` runs of the experiment that evaluated during
  training, optionally only those whose variant contains `--variant`. The arm is named by the method and the
  group size (`arpo_g4`, `grpo_g16`); the training seed is `train.seed` (or `project.seed` when null). Two
  runs of the same arm and seed: the newest counts, and the older is listed as superseded.
- **Run artifacts.** Each run's evaluation episodes and history come from its own artifacts (`evaluations/`,
  the last checkpoint's `state.json`), so the numbers are those of the logged run, not of whatever is in the
  working tree now. The base's episodes come from the newest `evaluate` run (`base.parquet`, the same
  instances), the hard/control split from the newest `baseline` run's rollouts (study.py,
  decision "Data-defined hard suite").
- **One suite per study.** A study is of one in-domain suite: with `suite` (the `env.in_domain_suite` of the
  params `arpo study` is given, e.g. `--preset replay-instances`), only runs of that suite count, so the
  family study and the pinned-instance study can share one MLflow experiment. A suite of pinned instances
  gives the instance document (arpo_core/analysis/study.py, decisions "Pinned-instance splits",
  "Final evaluation success", "Per-instance replay activity" and "Compared arms", `replay_instances.*`), any
  other the replay effect document (`replay_effect.*`).
- **One base per study.** A study also compares arms from one starting policy: with `base` (the params'
  `STUDY_BASE_KEYS`, `ground.checkpoint` and `policy.pretrained`, as `arpo study` is given them), only runs
  logged with those values count, for the train runs and for the baseline and evaluate runs alike. The
  rare-success study was recorded on grounded-xs and re-run on the reader (presets `replay-rare-15` and
  `replay-rare-read`: the same suite); without this the newest run of an arm and seed would silently stand
  for either base, and the hard split and the base's episodes would come from whichever ran last.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arpo_core.analysis.evaluation import Scorer
from arpo_core.analysis.study import ArmRun, instance_effect, replay_effect
from arpo_core.infra.fileio import atomic_open, atomic_write_json, atomic_write_text
from arpo_core.trajectory import Trajectory, read_trajectories
from tracking import mlflow_runs

__all__ = ["STUDY_BASE_KEYS", "gather", "instance_study", "study_base", "write_instance_study", "write_study"]

STUDY_BASE_KEYS = ("ground.checkpoint", "policy.pretrained")  # decision "One base per study"


def study_base(flat: dict[str, Any]) -> dict[str, str]:
    """Decision "One base per study": the base keys of flat params, as mlflow_runs.log_params logs them."""
    return {k: "null" if flat.get(k) is None else str(flat[k]) for k in STUDY_BASE_KEYS}


def _of_study(params: dict[str, str], suite: str | None, base: dict[str, str] | None) -> bool:
    """Decisions "One suite per study" and "One base per study": whether a run's logged params count."""
    if suite is not None and params.get("env.in_domain_suite") != suite:
        return False
    return all(params.get(k, "null") == v for k, v in (base or {}).items())


def _arm(params: dict[str, str]) -> str:
    """Decision "Study runs": the run's logged `method` (arpo_core/pipeline/common.py `method_name`, the one
    rule) with the group size after the method, and `_preload` (train.replay.preload baseline) before
    `_blind`: `arpo_g8`, `grpo_g8`, `arpo_g8_preload`, `arpo_g8_blind`."""
    method = params.get("method", "?")
    base, blind = method.removesuffix("_blind"), method.endswith("_blind")
    name = f"{base}_g{params.get('train.group_size', '?')}"
    if params.get("train.replay.preload", "none") not in ("none", "null", "None"):
        name += f"_{params['train.replay.preload'].replace('baseline', 'preload')}"
    return name + ("_blind" if blind else "")


def _of(suite: str | None, base: dict[str, str] | None) -> str:
    """' of <suite> from ground.checkpoint=...': what a study's runs must match, for its errors."""
    said = ", ".join(f"{k}={v}" for k, v in (base or {}).items() if v != "null")
    return (f" of {suite}" if suite else "") + (f" from {said}" if said else "")


def _newest(
    c: Any, experiment: str, stage: str, suite: str | None = None, base: dict[str, str] | None = None
) -> Any | None:
    for r in mlflow_runs.run_rows(c, experiment, stage):  # newest first
        if r["status"] != "FINISHED":
            continue
        run = c.get_run(r["run"])
        if _of_study(run.data.params, suite, base):
            return run
    return None


def _download(c: Any, run_id: str, path: str, dst: Path) -> Path:
    return Path(c.download_artifacts(run_id, path, str(dst)))


def gather(
    experiment: str,
    variant: str | None = None,
    root: str = ".",
    suite: str | None = None,
    base: dict[str, str] | None = None,
) -> tuple[list[ArmRun], list[Trajectory], list[Trajectory], Scorer, dict[str, Any]]:
    """Decisions "Study runs", "Run artifacts", "One suite per study" and "One base per study": (runs,
    baseline rollouts, base evaluation episodes, how the evaluation scored an episode, provenance)."""
    c = mlflow_runs.client(root)
    tmp = Path(tempfile.mkdtemp(prefix="arpo-study-"))
    chosen: dict[tuple[str, int], Any] = {}
    superseded: list[str] = []
    for row in mlflow_runs.run_rows(c, experiment, "train"):  # newest first
        run = c.get_run(row["run"])
        params = run.data.params
        if row["status"] != "FINISHED" or int(params.get("evaluate.during_training", "0")) <= 0:
            continue
        if variant and variant not in row["variant"]:
            continue
        if not _of_study(params, suite, base):
            continue
        seed = params.get("train.seed", "null")
        unset = seed in ("null", "None")  # mlflow_runs.log_params writes None as 'null' (older runs: 'None')
        key = (_arm(params), int(params.get("project.seed", "0") if unset else seed))
        if key in chosen:
            superseded.append(row["run"])
            continue
        chosen[key] = run
    runs: list[ArmRun] = []
    for (arm, seed), run in sorted(chosen.items()):
        rid = run.info.run_id
        evals_dir = _download(c, rid, "evaluations", tmp / rid)
        evaluations = {
            int(f.stem.split("-")[1]): read_trajectories(f) for f in sorted(evals_dir.glob("*.parquet"))
        }
        ckpts = [a.path for a in c.list_artifacts(rid, "checkpoint")]
        history = []
        if ckpts:
            state = _download(c, rid, f"{sorted(ckpts)[-1]}/state.json", tmp / rid)
            history = json.loads(state.read_text())["history"]
        runs.append(ArmRun(arm, seed, evaluations, history))
    baseline_run, evaluate_run = (
        _newest(c, experiment, "baseline", suite, base),
        _newest(c, experiment, "evaluate", suite, base),
    )
    if baseline_run is None or evaluate_run is None:
        missing = " and ".join(
            n for n, r in (("baseline", baseline_run), ("evaluate", evaluate_run)) if r is None
        )
        raise FileNotFoundError(
            f"experiment {experiment!r} has no finished {missing} run{_of(suite, base)}: the study reads the "
            "hard/control split "
            "from baseline's rollouts and the base's episodes from evaluate's (run the pipeline through "
            "`evaluate` once, e.g. `dvc repro` before queueing the arms, or `dvc exp run evaluate`)"
        )
    e = evaluate_run.data.params  # the study scores episodes as the evaluation did
    score = Scorer.of(e["evaluate.osworld_hard"] == "True", int(e["evaluate.max_steps"]))
    baseline = read_trajectories(_download(c, baseline_run.info.run_id, "trajectories", tmp / "baseline"))
    base_file = _download(c, evaluate_run.info.run_id, "trajectories/base.parquet", tmp / "evaluate")
    provenance = {
        "experiment": experiment,
        "base": dict(base or {}),
        "tracking_uri": mlflow_runs.tracking_uri(root),
        "train_runs": {f"{arm}/seed{seed}": run.info.run_id for (arm, seed), run in sorted(chosen.items())},
        "superseded_runs": superseded,
        "baseline_run": baseline_run.info.run_id,
        "evaluate_run": evaluate_run.info.run_id,
        "scoring": {"rule": score.rule, "max_steps": score.max_steps},
        "git_commits": sorted(
            {r.data.tags.get("mlflow.source.git.commit", "") for r in chosen.values()} - {""}
        ),
    }
    return runs, baseline, read_trajectories(base_file), score, provenance


def _plot(doc: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, arm in doc["arms"].items():
        pts = sorted((int(e), v) for e, v in arm["curve"].items() if v is not None)
        if pts:
            ax.plot(
                [e for e, _ in pts],
                [100 * v for _, v in pts],
                marker="o",
                label=f"{name} ({arm['seeds']} seeds)",
            )
    if doc["base"]["hard"] is not None:
        ax.axhline(100 * doc["base"]["hard"], color="#7f7f7f", linestyle="--", label="base")
    ax.set_xlabel("epoch")
    ax.set_ylabel("greedy success on the hard tasks (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _delta(d: dict[str, Any] | None) -> str:
    """'+1.2 points [-0.4, +2.9]' from a bootstrap_difference result."""
    if not d or d.get("mean") is None:
        return "-"
    ci = "" if not d.get("ci95") else f" [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]"
    return f"{100 * d['mean']:+.1f} points{ci}"


def _markdown(doc: dict[str, Any], png: str) -> str:
    untrained = doc.get("untrained_tasks") or []
    lines = [
        "# Replay effect",
        "",
        f"Hard tasks (sampled base success <= {doc['hard_max']:.0%}): {', '.join(doc['hard_tasks']) or 'none'}; "
        f"controls: {', '.join(doc['control_tasks']) or 'none'}"
        + (
            f"; not trained by any arm (dropped by the task selection), reported apart: {', '.join(untrained)}"
            if untrained
            else ""
        )
        + f". Success = greedy, averaged over the evaluations at epochs {doc['epochs_averaged']} and over seeds.",
        "",
        "| arm | seeds | hard | control |",
        "|---|---|---|---|",
        f"| base | - | {_pct(doc['base']['hard'])} | {_pct(doc['base']['control'])} |",
    ]
    lines += [
        f"| {n} | {a['seeds']} | {_pct(a['hard'])} | {_pct(a['control'])} |" for n, a in doc["arms"].items()
    ]
    blind = doc.get("image_blind")
    if blind:
        hit = {k: (blind.get(k) or {}).get("hit_rate") for k in ("hard", "control")}
        lines.append(f"| image-blind first click | - | {_pct(hit['hard'])} | {_pct(hit['control'])} |")
    lines += [
        "",
        "95% intervals: bootstrap over training seeds and evaluation instances (paired: every arm and the base",
        "played the same instances).",
        "",
        "| comparison | hard | control |",
        "|---|---|---|",
    ]
    arms = {"arpo": (doc.get("arpo") or {}).get("arm"), "grpo": (doc.get("grpo") or {}).get("arm")}
    for key, label in (
        ("arpo_minus_grpo", f"{arms['arpo']} - {arms['grpo']}"),
        ("arpo_minus_base", f"{arms['arpo']} - base"),
        ("grpo_minus_base", f"{arms['grpo']} - base"),
    ):
        d = doc.get(key) or {}
        lines.append(f"| {label} | {_delta(d.get('hard'))} | {_delta(d.get('control'))} |")
    lines += [
        "",
        f"![curves]({png})",
    ]
    return "\n".join(lines + _detail_tables(doc)) + "\n"


def _detail_tables(doc: dict[str, Any]) -> list[str]:
    """Per task, per seed, the replay counts and the click alignment, as far as the document has them."""
    arms = doc["arms"]
    untrained = doc.get("untrained_tasks") or []
    tasks = [*doc["hard_tasks"], *doc["control_tasks"], *untrained]
    out = ["", "## Per task (greedy success %, same instances for every arm)", ""]
    out += [
        "| task | split | sampled base | base | " + " | ".join(arms) + " |",
        "|---|---|---|---|" + "---|" * len(arms),
    ]
    sampled = doc.get("baseline_sampled_success", {})
    for t in tasks:
        split = "hard" if t in doc["hard_tasks"] else "untrained" if t in untrained else "control"
        row = [_pct(a.get("tasks", {}).get(t)) for a in arms.values()]
        base = _pct(doc["base"].get("tasks", {}).get(t))
        out.append(f"| {t} | {split} | {_pct(sampled.get(t))} | {base} | " + " | ".join(row) + " |")
    out += ["", "## Per seed (hard / control, %)", "", "| arm | seed | hard | control |", "|---|---|---|---|"]
    for name, a in arms.items():
        per = a.get("per_seed", {})
        for seed in sorted(per.get("hard", {}), key=str):
            out.append(
                f"| {name} | {seed} | {_pct(per['hard'][seed])} | {_pct(per.get('control', {}).get(seed))} |"
            )
    out += ["", "## All-fail groups and replay fills over training (per seed)", ""]
    for name, a in arms.items():
        for seed, counts in sorted(a.get("counts", {}).items(), key=lambda kv: str(kv[0])):
            fails = {k.split("/")[0]: int(v) for k, v in counts.items() if k.endswith("/all_fail_groups")}
            fills = {k.split("/")[0]: int(v) for k, v in counts.items() if k.endswith("/replay_fills")}
            per_task = ", ".join(f"{t} {fails[t]}/{fills.get(t, 0)}" for t in sorted(fails))
            out.append(
                f"- {name} seed {seed}: groups replayed {int(counts.get('train/replayed', 0))}; "
                f"per task all-fail/filled: {per_task or '-'}"
            )
    aligned = {
        n: a["click_alignment"] for n, a in {"base": doc["base"], **arms}.items() if a.get("click_alignment")
    }
    if aligned:
        out += [
            "",
            "## Click alignment (first click vs its DOM target, last evaluation, all tasks)",
            "",
            "The image-blind row of the first table is the hit rate of the best constant first click per task:",
            "a gain that follows the pixels raises the hit rate and the click-target correlation; one that",
            "moves clicks towards a better constant point raises neither.",
            "",
            "| arm | episodes | hit rate | click-target corr | spread px |",
            "|---|---|---|---|---|",
        ]
        for n, c in aligned.items():
            corr = "-" if c.get("click_target_corr") is None else f"{c['click_target_corr']:.2f}"
            spread = "-" if c.get("spread_px") is None else f"{c['spread_px']:.1f}"
            out.append(f"| {n} | {c.get('episodes')} | {_pct(c.get('hit_rate'))} | {corr} | {spread} |")
    return out


def write_study(doc: dict[str, Any], out: Path) -> list[Path]:
    """replay_effect.json, .md and .png beside it."""
    png = out.with_suffix(".png")
    atomic_write_json(out, doc, indent=1)
    _plot(doc, png)
    atomic_write_text(out.with_suffix(".md"), _markdown(doc, png.name))
    return [out, out.with_suffix(".md"), png]


def replay_study(
    experiment: str, out: Path, variant: str | None = None, hard_max: float = 0.25, reps: int = 2000,
    targets: Sequence[Any] = (), first_seed: int = 0, base: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Gather, compute (arpo_core.analysis.study.replay_effect) and write the study files."""
    runs, baseline, base_eval, score, provenance = gather(experiment, variant, base=base)
    if not runs:
        raise FileNotFoundError(
            f"experiment {experiment!r} has no finished train run{_of(None, base)} with "
            "evaluate.during_training > 0"
        )
    doc = replay_effect(
        runs,
        baseline,
        base_eval,
        score=score,
        hard_max=hard_max,
        reps=reps,
        targets=targets,
        first_seed=first_seed,
    )
    doc["provenance"] = provenance
    write_study(doc, out)
    return doc


# --------------------------------------------------------------------------------------------------
# The pinned-instance study (decision "One suite per study")

SPLIT_LABELS = {"train": "training instances", "heldout": "held-out instances"}


def _ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _instance_plot(doc: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.6))
    FigureCanvasAgg(fig)
    for i, split in enumerate(("train", "heldout")):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, arm in doc["arms"].items():
            pts = sorted((int(e), v) for e, v in arm["curve"].get(split, {}).items() if v is not None)
            if pts:
                ax.plot(
                    [e for e, _ in pts],
                    [100 * v for _, v in pts],
                    marker="o",
                    label=f"{name} ({arm['seeds']})",
                )
        if doc["base"].get(split) is not None:
            ax.axhline(100 * doc["base"][split], color="#7f7f7f", linestyle="--", label="base")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"greedy success, {SPLIT_LABELS[split]} (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _instance_markdown(doc: dict[str, Any], png: str) -> str:
    n = doc["splits"]
    lines = [
        "# Replay on pinned instances (the paper's protocol)",
        "",
        f"{n.get('train', 0)} training instances (the selection's, every arm the same), "
        f"{len(doc['heldout_tasks'])} task families on held-out instances; GRPO group size "
        f"{doc['group_size']}. Greedy success of the final policy (epoch {doc['epoch_evaluated']}) with 95% "
        "intervals over training seeds and instances; the base on the same instances.",
        "",
        "| arm | seeds | training instances | held-out instances |",
        "|---|---|---|---|",
        f"| base | - | {_pct(doc['base'].get('train'))}{_ci(doc['base_ci95'].get('train'))} | "
        f"{_pct(doc['base'].get('heldout'))}{_ci(doc['base_ci95'].get('heldout'))} |",
    ]
    for name, a in doc["arms"].items():
        lines.append(
            f"| {name} | {a['seeds']} | {_pct(a.get('train'))}{_ci(a.get('train_ci95'))} | "
            f"{_pct(a.get('heldout'))}{_ci(a.get('heldout_ci95'))} |"
        )
    lines += ["", "Paired differences (points, 95% interval over seeds and instances):", "",
              "| comparison | training instances | held-out instances |", "|---|---|---|"]  # fmt: skip
    for key, label in (
        ("arpo_minus_grpo", "ARPO - GRPO"),
        ("arpo_preload_minus_grpo", "ARPO (preload) - GRPO"),
        ("arpo_preload_minus_arpo", "ARPO (preload) - ARPO"),
        ("arpo_minus_base", "ARPO - base"),
        ("grpo_minus_base", "GRPO - base"),
        ("arpo_preload_minus_base", "ARPO (preload) - base"),
        ("image_blind_minus_base", "image-blind ARPO - base"),
        ("arpo_minus_image_blind", "ARPO - image-blind ARPO"),
    ):
        d = doc.get(key) or {}
        lines.append(f"| {label} | {_delta(d.get('train'))} | {_delta(d.get('heldout'))} |")
    lines += ["", f"![curves]({png})", "", "## Per training instance", "",
              "Sampled base success (baseline, 16 rollouts) and, per arm, all-fail groups / replay fills over "
              "training (mean over seeds).", ""]  # fmt: skip
    arms = list(doc["arms"])
    lines += ["| instance | sampled base | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for inst in doc["train_instances"]:
        cells = []
        for a in arms:
            c = doc["arms"][a]["counts"].get(inst, {})
            cells.append(f"{c.get('all_fail_groups', 0):.1f} / {c.get('replay_fills', 0):.1f}")
        lines.append(
            f"| {inst} | {_pct(doc['baseline_sampled_success'].get(inst))} | " + " | ".join(cells) + " |"
        )
    lines += ["", "## Per seed (greedy success %, training / held-out instances)", "", "| arm | seed | training | held-out |",
              "|---|---|---|---|"]  # fmt: skip
    for name, a in doc["arms"].items():
        for seed in sorted(a["train_per_seed"], key=int):
            lines.append(
                f"| {name} | {seed} | {_pct(a['train_per_seed'][seed])} | {_pct(a['heldout_per_seed'].get(seed))} |"
            )
    return "\n".join(lines) + "\n"


def write_instance_study(doc: dict[str, Any], out: Path) -> list[Path]:
    """replay_instances.json, .md and .png beside it."""
    png = out.with_suffix(".png")
    atomic_write_json(out, doc, indent=1)
    _instance_plot(doc, png)
    atomic_write_text(out.with_suffix(".md"), _instance_markdown(doc, png.name))
    return [out, out.with_suffix(".md"), png]


def instance_study(
    experiment: str, out: Path, suite: str, variant: str | None = None, reps: int = 2000,
    base: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Gather the runs of `suite` (and `base`), compute (arpo_core.analysis.study.instance_effect) and write
    the files."""
    runs, baseline, base_eval, score, provenance = gather(experiment, variant, suite=suite, base=base)
    if not runs:
        raise FileNotFoundError(
            f"experiment {experiment!r} has no finished train run{_of(suite, base)} with "
            "evaluate.during_training > 0"
        )
    doc = instance_effect(runs, baseline, base_eval, score=score, reps=reps)
    doc["provenance"] = provenance | {"suite": suite}
    write_instance_study(doc, out)
    return doc
