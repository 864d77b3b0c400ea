"""Drivers of the recorded results of issues #4 (base policy), #5 (learning) and #8 (comparison).

    .venv/bin/python benchmarks/recorded_runs.py base --policy models/base
        # -> benchmarks/results/base_policy.json
    .venv/bin/python benchmarks/recorded_runs.py learning --base models/base
        # -> benchmarks/results/learning.json   (ARPO and GRPO, evaluated every --eval-every epochs)
    .venv/bin/python benchmarks/recorded_runs.py comparison --base models/base
        # -> benchmarks/results/comparison.json + comparison.md (base, rft, dpo, kto, grpo, arpo)
    common options: --name NAME (work dir runs/recorded/NAME), --work DIR, --out FILE,
                    --preset recorded, -S key=value (params overrides, repeatable)

Decisions:
1. Only the pipeline's own stage functions run the work (`stages.baseline`, `select`, `train_stage`,
   `offline_baseline`, `evaluate`) and the evaluation helper they use (`evaluate.evaluate_policy`), with
   params from params.yaml + preset `recorded` + -S overrides, so a recorded number is what the
   pipeline produces, not what a benchmark re-implements.
2. One work dir per name (runs/recorded/NAME, gitignored) holds everything: targets, baseline rollouts,
   the task selection, the ARPO/GRPO runs, the offline baselines and evaluation trajectories. Every step
   is skipped when its output is there (`train_stage` resumes from its last checkpoint), so `comparison`
   after `learning` reuses its baseline, selection and final ARPO/GRPO policies (same base, same
   selection for every method), and a killed run continues.
3. Greedy evaluation on env seeds `evaluate.seed + k` (`evaluate.eval_jobs`), the same instances for
   every method and epoch (paired comparison); the DOM targets of exactly those instances
   (`probe.first_step_targets`) give the image-blind ceiling and click alignment (`probe`).
4. Per-epoch evaluation goes through `train_stage(on_epoch=...)`; its numbers are returned into the
   trainer's checkpointed history (`probe/...` keys), and the JSON is built from that history, so a
   resumed run still reports the epochs evaluated before the kill. Evaluating all of 6 tasks x 50
   episodes after every epoch would cost more than training, hence `--eval-every` (the last epoch is
   always evaluated). Epoch 0 is the base evaluation.
5. Every JSON records wall seconds per stage (`wall_s`), the command, the machine and the date.
6. Changes are judged PAIRED on those shared instances (`probe.paired_difference`): each evaluated
   epoch against the base (`vs_base`: delta, its 95% interval, wins/losses, exact sign-test p), ARPO
   against GRPO at the epochs both evaluated (`arpo_vs_grpo`), and in `comparison` every method
   against the base per split. Two independent 300-episode intervals are +-5 points wide; the paired
   interval removes the instance-difficulty variance the two share.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core import stages  # noqa: E402
from arpo_core.config import Params, load_params  # noqa: E402
from arpo_core.envs.base import TaskSpec  # noqa: E402
from arpo_core.fileio import atomic_write_json, atomic_write_text  # noqa: E402
from arpo_core.probe import (  # noqa: E402
    TargetRecord,
    blind_ceiling,
    click_alignment,
    first_step_targets,
    paired_difference,
)
from arpo_core.trajectory import Trajectory, read_trajectories, write_trajectories  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OFFLINE = ("rft", "dpo", "kto")
RL = {"arpo": (), "grpo": ("train.replay.enabled=false",)}


class Run:
    """Params, work dir and the per-stage wall clock of one subcommand."""

    def __init__(self, args: argparse.Namespace, extra: Sequence[str] = ()):
        self.args = args
        self.overrides = list(args.set or [])
        self.p: Params = self.params(extra)
        self.work = Path(args.work or ROOT / "runs" / "recorded" / args.name).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.wall: dict[str, float] = {}

    def params(self, extra: Sequence[str] = ()) -> Params:
        return load_params(ROOT / "params.yaml", [*self.overrides, *extra], preset=self.args.preset)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wall[name] = round(self.wall.get(name, 0.0) + time.perf_counter() - t0, 2)
            print(f"[recorded] {name}: {self.wall[name]:.1f} s", flush=True)

    def header(self) -> dict[str, Any]:
        import torch

        return {
            "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
            "preset": self.args.preset,
            "overrides": self.overrides,
            "work_dir": str(self.work),
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "torch_threads": self.p.project.torch_threads,
                "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            "params": {
                "in_domain_suite": self.p.env.in_domain_suite,
                "out_of_domain_suite": self.p.env.out_of_domain_suite,
                "n_envs": self.p.env.n_envs,
                "evaluate": dataclasses.asdict(self.p.evaluate),
                "baseline": dataclasses.asdict(self.p.baseline),
                "train": dataclasses.asdict(self.p.train),
            },
        }

    def write(self, out: Path, doc: dict[str, Any]) -> None:
        doc = {**self.header(), **doc, "wall_s": dict(self.wall)}
        atomic_write_json(out, doc, indent=1)
        print(f"[recorded] wrote {out}", flush=True)


# ------------------------------------------------------------------------------------------------
# Pieces


def fingerprint(policy: Path) -> dict[str, Any]:
    """Path, size and mtime of a checkpoint's files: which base a work dir's outputs came from."""
    files = sorted(f for f in policy.iterdir() if f.is_file())
    return {"path": str(policy), "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def bind_base(run: Run, base: Path) -> None:
    """A work dir serves one base policy (decision 2): refuse to mix outputs of two bases."""
    path = run.work / "base_policy.fingerprint.json"
    fp = fingerprint(base)
    if path.exists() and json.loads(path.read_text()) != fp:
        raise SystemExit(
            f"{run.work} holds outputs of another (or a changed) base policy than {base}; "
            "use another --name / --work, or delete the work dir"
        )
    atomic_write_json(path, fp, indent=1)


def targets(run: Run, tasks: Sequence[TaskSpec], split: str = "in_domain") -> list[TargetRecord]:
    """DOM targets of the evaluation instances (decision 3), cached in the work dir."""
    e = run.p.evaluate
    ids = [[t.task_id, t.config] for t in tasks]
    path = run.work / f"targets-{split}-{e.seed}-{e.episodes_per_task}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        if cached["tasks"] == ids:
            return [TargetRecord.from_dict(r) for r in cached["records"]]
    from arpo_core.envs.miniwob import MiniWoBEnv

    with run.timed(f"targets_{split}"):
        env = MiniWoBEnv(episode_time_limit_s=run.p.env.episode_time_limit_s)
        try:
            recs = first_step_targets(env, tasks, range(e.seed, e.seed + e.episodes_per_task))
        finally:
            env.close()
    atomic_write_json(path, {"tasks": ids, "records": [r.as_dict() for r in recs]}, indent=1)
    return recs


def evaluate_in_domain(
    run: Run, pool: Any, policy: Any, policy_dir: Path, tasks: Sequence[TaskSpec], name: str
) -> tuple[dict[str, float], list[Trajectory]]:
    """Greedy in-domain evaluation of a loaded policy, exactly as the evaluate stage runs it."""
    from arpo_core.evaluate import evaluate_policy
    from arpo_core.policy.generate import HFGenerator

    p, e = run.p, run.p.evaluate
    gen = HFGenerator(policy, system=p.policy.system_prompt, history_images=p.policy.history_images)
    res = evaluate_policy(
        pool,
        gen,
        tasks,
        e.episodes_per_task,
        e.temperature,
        e.seed,
        rollout=stages._rollout_cfg(p, policy_dir, e.temperature, e.max_steps, e.seed),
        prefix=f"eval/{name}",
        run_id=f"recorded-{name}",
    )
    return res.metrics, res.trajectories


def split_summary(
    metrics: dict[str, float], prefix: str, split: str, tasks: Sequence[TaskSpec]
) -> dict[str, Any]:
    """Rate, 95% interval, episodes of one split and of each of its tasks, from `summarize` keys."""
    g = metrics.get
    out: dict[str, Any] = {
        split: g(f"{prefix}/{split}/success_rate"),
        "ci95": [g(f"{prefix}/{split}/success_ci_low"), g(f"{prefix}/{split}/success_ci_high")],
        "episodes": int(g(f"{prefix}/{split}/episodes", 0)),
        "format_error_rate": g(f"{prefix}/{split}/format_error_rate"),
        "failed_jobs": int(g(f"{prefix}/all/failed_jobs", 0)),
        "tasks": {},
    }
    for t in tasks:
        k = f"{prefix}/task/{t.domain}/{t.task_id}"
        if f"{k}/success_rate" in metrics:
            out["tasks"][t.task_id] = {
                "success": metrics[f"{k}/success_rate"],
                "ci95": [metrics[f"{k}/success_ci_low"], metrics[f"{k}/success_ci_high"]],
                "episodes": int(metrics[f"{k}/episodes"]),
            }
    return out


def base_eval(run: Run, pool: Any, base: Path, tasks: Sequence[TaskSpec], recs: list[TargetRecord]) -> dict:
    """In-domain greedy evaluation of the base with click alignment; cached in the work dir."""
    from arpo_core.policy.model import load_policy

    path = run.work / "base_eval.json"
    traj_path = run.work / "eval" / "base-in_domain.parquet"
    key = {
        "policy": fingerprint(base),
        "policy_params": dataclasses.asdict(run.p.policy),
        "evaluate": dataclasses.asdict(run.p.evaluate),
        "tasks": [[t.task_id, t.config] for t in tasks],
    }
    if path.exists() and traj_path.exists():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached["result"]
    with run.timed("evaluate_base"):
        metrics, trajs = evaluate_in_domain(run, pool, load_policy(base), base, tasks, "base")
    write_trajectories(traj_path, trajs)
    result = split_summary(metrics, "eval/base", "in_domain", tasks)
    result["click_alignment"] = click_alignment(trajs, recs, run.p.evaluate.seed)
    atomic_write_json(path, {"key": key, "result": result}, indent=1)
    return result


def baseline_and_select(run: Run, base: Path) -> Path:
    """The shared baseline rollouts and task selection (decision 2) -> the selection file."""
    bdir, sel = run.work / "baseline", run.work / "selected_tasks.json"
    if not (bdir / "in_domain.parquet").exists():
        with run.timed("baseline"):
            stages.baseline(run.p, base, bdir)
    if not sel.exists():
        with run.timed("select"):
            stages.select(run.p, bdir, sel)
    return sel


def _probe_metrics(summary: dict[str, Any], align: dict[str, Any]) -> dict[str, float]:
    """Per-epoch evaluation as flat floats for the trainer's checkpointed history (decision 4)."""
    out = {"probe/in_domain": float(summary["in_domain"]), "probe/episodes": float(summary["episodes"])}
    out["probe/ci_low"], out["probe/ci_high"] = (float(v) for v in summary["ci95"])
    corr = align["pooled"]["click_target_corr"]
    out["probe/click_target_corr"] = float("nan") if corr is None else float(corr)
    hit = align["pooled"]["hit_rate"]
    out["probe/hit_rate"] = float("nan") if hit is None else float(hit)
    for task, v in summary["tasks"].items():
        out[f"probe/task/{task}"] = float(v["success"])
    return out


def _nan_none(x: float) -> float | None:
    return None if x != x else x


def epochs_from_history(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue-#5 epoch entries from a trainer history (epochs without a probe are skipped)."""
    out = []
    for h in history:
        if "probe/in_domain" not in h:
            continue
        out.append(
            {
                "epoch": int(h["epoch"]),
                "in_domain": h["probe/in_domain"],
                "episodes": int(h["probe/episodes"]),
                "click_target_corr": _nan_none(h["probe/click_target_corr"]),
                "ci95": [h["probe/ci_low"], h["probe/ci_high"]],
                "first_click_hit_rate": _nan_none(h["probe/hit_rate"]),
                "tasks": {k.split("/", 2)[2]: v for k, v in h.items() if k.startswith("probe/task/")},
                "rollout_success_rate": h.get("rollout/success_rate"),
                "replay_groups_filled": h.get("replay/groups_filled"),
            }
        )
    return out


def _paired_brief(d: dict[str, Any]) -> dict[str, Any]:
    keep = ("n", "delta", "ci95", "wins", "losses", "sign_test_p")
    return {k: d[k] for k in keep}


def _task_alignment(trajs: Sequence[Trajectory], recs: Sequence[TargetRecord], seed: int) -> dict[str, Any]:
    """Per-task hit rate, click/target correlations and click spread of one evaluation."""
    tasks = click_alignment(trajs, list(recs), seed)["tasks"]
    return {t: {k: v for k, v in a.items() if k != "episodes"} for t, a in tasks.items()}


def add_paired(
    run: Run, doc: dict[str, Any], methods: Sequence[str], recs: Sequence[TargetRecord] = ()
) -> None:
    """Analyses of the evaluations on disk (decision 6): every evaluated epoch of every method paired
    with the base (`vs_base` in its epoch entry), ARPO paired with GRPO at the epochs both evaluated
    (`arpo_vs_grpo`: ARPO minus GRPO), and, given the DOM target records, per-task click alignment of
    the base and of every evaluated epoch (`task_click_alignment`: does a task's gain follow the
    target or move a constant click?)."""
    ev = run.work / "eval"
    base_path = ev / "base-in_domain.parquet"
    if not base_path.exists():
        return
    base = read_trajectories(base_path)
    seed = run.p.evaluate.seed
    if recs:
        doc["base"]["task_click_alignment"] = _task_alignment(base, recs, seed)
    cache: dict[tuple[str, int], list[Trajectory]] = {}

    def load(method: str, epoch: int) -> list[Trajectory] | None:
        path = ev / f"{method}-epoch-{epoch:04d}.parquet"
        if (method, epoch) not in cache and path.exists():
            cache[method, epoch] = read_trajectories(path)
        return cache.get((method, epoch))

    for method in methods:
        for entry in doc[method]["epochs"]:
            trajs = load(method, entry["epoch"]) if entry["epoch"] > 0 else None
            if trajs is not None:
                entry["vs_base"] = _paired_brief(paired_difference(base, trajs))
                if recs:
                    entry["task_click_alignment"] = _task_alignment(trajs, recs, seed)
    if {"arpo", "grpo"} <= set(methods):
        common = sorted(
            {e["epoch"] for e in doc["arpo"]["epochs"]} & {e["epoch"] for e in doc["grpo"]["epochs"]} - {0}
        )
        rows = []
        for epoch in common:
            a, g = load("arpo", epoch), load("grpo", epoch)
            if a is not None and g is not None:
                rows.append({"epoch": epoch, **_paired_brief(paired_difference(g, a))})
        doc["arpo_vs_grpo"] = rows


def train_method(
    run: Run,
    method: str,
    base: Path,
    sel: Path,
    *,
    pool: Any = None,
    tasks: Sequence[TaskSpec] = (),
    recs: Sequence[TargetRecord] = (),
    eval_every: int = 0,
) -> tuple[Path, list[dict[str, Any]]]:
    """Train ARPO or GRPO (decision 1) from `base`; with a pool, evaluate every `eval_every` epochs and
    at the last one (decision 4). Returns the final policy dir and the trainer history."""
    p = run.params(RL[method])
    out = run.work / method

    def on_epoch(epoch: int, policy: Any) -> dict[str, float] | None:
        if pool is None or not (epoch == p.train.epochs or (eval_every and epoch % eval_every == 0)):
            return None
        t0 = time.perf_counter()
        metrics, trajs = evaluate_in_domain(run, pool, policy, base, tasks, f"{method}-{epoch}")
        write_trajectories(run.work / "eval" / f"{method}-epoch-{epoch:04d}.parquet", trajs)
        summary = split_summary(metrics, f"eval/{method}-{epoch}", "in_domain", tasks)
        align = click_alignment(trajs, list(recs), p.evaluate.seed)
        run.wall[f"evaluate_{method}_epochs"] = round(
            run.wall.get(f"evaluate_{method}_epochs", 0.0) + time.perf_counter() - t0, 2
        )
        return _probe_metrics(summary, align)

    with run.timed(f"train_{method}"):
        stages.train_stage(p, base, sel, out, on_epoch=on_epoch)
    from arpo_core.trainer import latest_checkpoint

    ckpt = latest_checkpoint(out)
    history = json.loads((ckpt / "state.json").read_text())["history"] if ckpt else []
    return out / "policy", history


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _grounding_section(policy: Path) -> dict[str, Any]:
    """The grounding recipe and compute (benchmarks/results/grounding.json) and, when the policy
    carries one, its ground stage report's held-out measures."""
    out: dict[str, Any] = {}
    g = RESULTS / "grounding.json"
    if g.exists():
        doc = json.loads(g.read_text())
        out = {k: doc[k] for k in ("recipe", "compute", "total_compute_cpu_s", "verdict") if k in doc}
        out["source"] = "benchmarks/results/grounding.json"
    report = policy / stages.GROUND_REPORT
    if report.exists():
        out["ground_report_measures"] = json.loads(report.read_text()).get("measures")
    return out


def _mean_ceiling(ceiling: dict[str, dict[str, Any]]) -> float | None:
    return ceiling.get("_mean", {}).get("hit_rate")


# ------------------------------------------------------------------------------------------------
# Subcommands


def cmd_base(args: argparse.Namespace) -> Path:
    """Issue #4: the base policy per task, beside the image-blind ceiling and click alignment."""
    run = Run(args)
    policy = stages.resolve_policy(Path(args.policy).resolve())
    bind_base(run, policy)
    stages.setup_torch(run.p)
    tasks = stages.suite_tasks(run.p, "in_domain")
    recs = targets(run, tasks)
    with stages.make_pool(run.p) as pool:
        base = base_eval(run, pool, policy, tasks, recs)
    ceiling = blind_ceiling(recs)
    align = base["click_alignment"]
    out = Path(args.out or RESULTS / "base_policy.json")
    run.write(
        out,
        {
            "issue": 4,
            "policy": str(policy),
            "grounding": _grounding_section(policy),
            "in_domain": base["in_domain"],
            "ci95": base["ci95"],
            "episodes": base["episodes"],
            "image_blind": {
                "in_domain": _mean_ceiling(ceiling),
                "in_domain_cv": ceiling.get("_mean", {}).get("cv_hit_rate"),
                "tasks": ceiling,
            },
            "click_target_corr": align["pooled"]["click_target_corr"],
            "tasks": {
                t: {**v, "image_blind": ceiling[t]["hit_rate"], "click": align["tasks"].get(t)}
                for t, v in base["tasks"].items()
            },
            "click_alignment": align,
            "format_error_rate": base["format_error_rate"],
            "failed_jobs": base["failed_jobs"],
        },
    )
    return out


def _start(args: argparse.Namespace) -> tuple[Run, Path, list, list]:
    """The common start of `learning` and `comparison`: work dir bound to the base policy, torch set up,
    the in-domain tasks and their first-step targets."""
    run = Run(args)
    base = stages.resolve_policy(Path(args.base).resolve())
    bind_base(run, base)
    stages.setup_torch(run.p)
    tasks = stages.suite_tasks(run.p, "in_domain")
    return run, base, tasks, targets(run, tasks)


def cmd_learning(args: argparse.Namespace) -> Path:
    """Issue #5: per-epoch in-domain success of ARPO and GRPO from the same base and selection."""
    run, base, tasks, recs = _start(args)
    ceiling = blind_ceiling(recs)
    doc: dict[str, Any] = {"issue": 5, "policy": str(base)}
    with stages.make_pool(run.p) as pool:
        b = base_eval(run, pool, base, tasks, recs)
        doc["base"] = {
            "in_domain": b["in_domain"],
            "episodes": b["episodes"],
            "ci95": b["ci95"],
            "click_target_corr": b["click_alignment"]["pooled"]["click_target_corr"],
            "tasks": {t: v["success"] for t, v in b["tasks"].items()},
        }
        doc["image_blind"] = {
            "in_domain": _mean_ceiling(ceiling),
            "in_domain_cv": ceiling.get("_mean", {}).get("cv_hit_rate"),
            "tasks": {t: v["hit_rate"] for t, v in ceiling.items() if not t.startswith("_")},
        }
        sel = baseline_and_select(run, base)
        doc["selection"] = json.loads(sel.read_text())
        epoch0 = {
            "epoch": 0,
            "in_domain": b["in_domain"],
            "episodes": b["episodes"],
            "click_target_corr": doc["base"]["click_target_corr"],
            "ci95": b["ci95"],
        }
        for method in args.methods:
            _, history = train_method(
                run, method, base, sel, pool=pool, tasks=tasks, recs=recs, eval_every=args.eval_every
            )
            doc[method] = {"epochs": [epoch0, *epochs_from_history(history)], "train_history": history}
    add_paired(run, doc, args.methods, recs)
    out = Path(args.out or RESULTS / "learning.json")
    run.write(out, doc)
    return out


def cmd_comparison(args: argparse.Namespace) -> Path:
    """Issue #8: base, RFT, DPO, KTO, GRPO, ARPO in-domain and out-of-domain, same base and seeds."""
    from arpo_core.envs.oracles import ORACLES
    from arpo_core.report import comparison_table

    run, base, tasks, recs = _start(args)
    ood = stages.suite_tasks(run.p, "out_of_domain")
    ood_measurable = [t for t in ood if t.task_id in ORACLES]  # targets need a DOM oracle
    ood_recs = targets(run, ood_measurable, "out_of_domain") if ood_measurable else []
    sel = baseline_and_select(run, base)
    policies: dict[str, Path] = {"base": base}
    skipped: dict[str, str] = {}
    for m in OFFLINE:
        out = run.work / m
        if not (out / "config.json").exists():
            try:
                with run.timed(f"train_{m}"):
                    stages.offline_baseline(run.p, m, base, run.work / "baseline", out)
            except ValueError as e:  # e.g. RFT/DPO without a successful baseline rollout: no data
                skipped[m] = str(e)
                print(f"[recorded] {m} skipped: {e}", flush=True)
                continue
        policies[m] = out
    for m in ("grpo", "arpo"):
        final = run.work / m / "policy"
        if args.retrain or not (final / "config.json").exists():
            final, _ = train_method(run, m, base, sel)
        policies[m] = final
    metrics_path = run.work / "comparison_metrics.json"
    with run.timed("evaluate"):
        metrics = stages.evaluate(
            run.p, {k: str(v) for k, v in policies.items()}, run.work / "eval_cmp", metrics_path
        )
    ceiling, ood_ceiling = blind_ceiling(recs), blind_ceiling(ood_recs)
    doc: dict[str, Any] = {"issue": 8, "policy": str(base), "methods": {}, "skipped": skipped}
    ids = {x.task_id for x in tasks}
    base_trajs = read_trajectories(run.work / "eval_cmp" / "base.parquet")
    for m in policies:
        pre = f"eval/{m}/greedy"
        ind = split_summary(metrics, pre, "in_domain", tasks)
        oo = split_summary(metrics, pre, "out_of_domain", ood)
        trajs = base_trajs if m == "base" else read_trajectories(run.work / "eval_cmp" / f"{m}.parquet")
        align = click_alignment([t for t in trajs if t.task_id in ids], recs, run.p.evaluate.seed)
        ood_align = click_alignment([t for t in trajs if t.task_id not in ids], ood_recs, run.p.evaluate.seed)
        doc[m] = {
            "in_domain": ind["in_domain"],
            "out_of_domain": oo["out_of_domain"],
            "episodes": ind["episodes"] + oo["episodes"],
            "in_domain_ci95": ind["ci95"],
            "out_of_domain_ci95": oo["ci95"],
            "episodes_per_task": run.p.evaluate.episodes_per_task,
            "click_target_corr": align["pooled"]["click_target_corr"],
            "out_of_domain_click_target_corr": ood_align["pooled"]["click_target_corr"],
            "click_alignment": {"in_domain": align, "out_of_domain": ood_align},
            "tasks": {**ind["tasks"], **oo["tasks"]},
        }
        doc["methods"][m] = str(policies[m])
        if m != "base":
            doc[m]["vs_base"] = {  # paired on the same instances (probe decision 8)
                split: _paired_brief(
                    paired_difference(
                        [t for t in base_trajs if (t.task_id in ids) == inside],
                        [t for t in trajs if (t.task_id in ids) == inside],
                    )
                )
                for split, inside in (("in_domain", True), ("out_of_domain", False))
            }

    ood_all = len(ood_measurable) == len(ood)
    doc["image_blind"] = {
        "in_domain": ceiling.get("_mean", {}).get("hit_rate"),
        "in_domain_cv": ceiling.get("_mean", {}).get("cv_hit_rate"),
        "out_of_domain": ood_ceiling.get("_mean", {}).get("hit_rate") if ood_all else None,
        "tasks": {t: v["hit_rate"] for c in (ceiling, ood_ceiling) for t, v in c.items() if t[0] != "_"},
    }
    doc["image_blind_note"] = (
        "best constant click per task from the DOM targets of the evaluation instances; the "
        "out-of-domain mean only when every out-of-domain task has a DOM oracle (else per task only: "
        f"{sorted(t.task_id for t in ood_measurable)})"
    )
    md, _ = comparison_table({m: metrics for m in policies}, prefix="eval/{method}/greedy")
    blind, oblind = doc["image_blind"]["in_domain"], doc["image_blind"]["out_of_domain"]
    if blind is not None:
        ood_cell = "-" if oblind is None else f"{100 * oblind:.1f}"
        md += f"| image-blind ceiling | {100 * blind:.1f} | - | - | {ood_cell} | - | - |\n"
    corr = "\n".join(f"| {m} | {_fmt(doc[m]['click_target_corr'])} |" for m in policies)
    out = Path(args.out or RESULTS / "comparison.json")
    md_doc = (
        "# Comparison (issue #8)\n\nGreedy success (%) with 95% intervals, "
        f"{run.p.evaluate.episodes_per_task} episodes per task, env seeds {run.p.evaluate.seed}+k.\n\n"
        f"{md}\nClick alignment (within-task correlation of first click and target centre, in-domain):\n\n"
        f"| method | click_target_corr |\n|---|---|\n{corr}\n\nCommand: `{run.header()['command']}`\n"
    )
    for m, why in skipped.items():
        md_doc += f"\n{m}: not trained ({why}).\n"
    run.write(out, doc)
    atomic_write_text(out.with_suffix(".md"), md_doc)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--name", default="main", help="work dir runs/recorded/NAME")
        sp.add_argument("--work", default=None, help="work dir (overrides --name)")
        sp.add_argument("--out", default=None, help="result JSON (default benchmarks/results/...)")
        sp.add_argument("--preset", default="recorded")
        sp.add_argument("-S", "--set", action="append", default=[], help="params override key=value")

    b = sub.add_parser("base", help="issue #4: base_policy.json")
    b.add_argument("--policy", required=True)
    common(b)
    b.set_defaults(fn=cmd_base)
    lr = sub.add_parser("learning", help="issue #5: learning.json")
    lr.add_argument("--base", required=True)
    lr.add_argument("--eval-every", type=int, default=6, help="evaluate every N epochs (and the last)")
    lr.add_argument("--methods", nargs="+", default=["arpo", "grpo"], choices=list(RL))
    common(lr)
    lr.set_defaults(fn=cmd_learning)
    c = sub.add_parser("comparison", help="issue #8: comparison.json + comparison.md")
    c.add_argument("--base", required=True)
    c.add_argument("--retrain", action="store_true", help="retrain ARPO/GRPO even if the work dir has them")
    common(c)
    c.set_defaults(fn=cmd_comparison)
    return ap


def main(argv: Sequence[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    os.chdir(ROOT)  # suite paths in params.yaml are relative to the repository root
    main()
