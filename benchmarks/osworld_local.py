"""The osworld-local preset measured (issue 16 item 3): the whole pipeline on the project's own Xvfb
desktops, through its front door, in a fresh copy of the project:

    arpo run --preset osworld-local --target evaluate

(init_policy -> ground -> demos -> sft -> baseline -> select -> train -> evaluate; the offline baselines
and the comparison table are not needed for these numbers). Then the greedy evaluation episodes of the
base and the trained policy (`data/eval/{base,arpo}.parquet`, the same tasks and episode count) are
summarised with the evaluate stage's own statistics (`evaluate.summarize`: success with its 95% interval,
the episode format-error rate - an episode with any reply that did not parse -, mean steps), for the
suite, per domain and per task, plus each stage's wall time (its MLflow run in the copy).

With `evaluate.sampled_temperature` set (the preset sets 1.0) the sampled episodes are summarised too,
and base and trained policy are compared episode by episode on both (paired difference, 95% interval).

    .venv/bin/python benchmarks/osworld_local.py [--work /tmp/osworld-local] [-S key=value ...]
    # writes benchmarks/results/osworld_local.json
    # --reuse: keep an existing copy (its code and outputs; only the preset file is refreshed), so only
    #          the stages whose params changed run again (e.g. a larger evaluation)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import SOURCE, VENV_BIN, child_env, copy_project, source_state  # noqa: E402

from arpo_core.analysis.evaluation import Scorer, summarize  # noqa: E402
from arpo_core.analysis.probe import paired_difference  # noqa: E402
from arpo_core.config import load_params  # noqa: E402
from arpo_core.pipeline.table import upstream  # noqa: E402
from arpo_core.trajectory import Trajectory, read_trajectories  # noqa: E402


def stage_times(project: Path, experiment: str) -> dict[str, int]:
    """Seconds of each stage's newest finished MLflow run in the copy (a stage an `--reuse` run skipped
    keeps the time of the run that produced its outputs)."""
    from tracking import mlflow_runs

    stages = upstream(["evaluate"])
    out: dict[str, int] = {}
    for row in mlflow_runs.run_rows(mlflow_runs.client(project), experiment):  # newest first
        if row["status"] == "FINISHED" and row["minutes"] is not None and row["stage"] in stages:
            out.setdefault(row["stage"], round(60 * row["minutes"]))
    return {k: out[k] for k in stages if k in out}


def summary(trajs: list[Trajectory], score: Scorer) -> dict:
    """The evaluate stage's own statistics (`evaluate.summarize`: success with its 95% interval, format
    errors, mean steps, episodes), for the whole suite, per domain and per task."""
    stats = summarize(
        trajs, {t.key: "suite" for t in trajs}, scoring=score.rule, max_steps=score.max_steps, prefix="m"
    )

    def cell(name: str) -> dict:
        return {
            "success": stats[f"m/{name}/success_rate"],
            "ci95": [stats[f"m/{name}/success_ci_low"], stats[f"m/{name}/success_ci_high"]],
            "format_error_rate": stats[f"m/{name}/format_error_rate"],
            "mean_steps": stats[f"m/{name}/mean_steps"],
            "episodes": int(stats[f"m/{name}/episodes"]),
        }

    out = cell("suite")
    out["by_domain"] = {d: cell(f"domain/{d}") for d in sorted({t.task_domain for t in trajs})}
    out["per_task"] = {f"{d}/{i}": cell(f"task/{d}/{i}") for d, i in sorted({t.key for t in trajs})}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="osworld-local")
    ap.add_argument("--work", type=Path, default=Path("/tmp/osworld-local"), help="the project copy (wiped)")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], help="params override")
    ap.add_argument("--timeout", type=float, default=3 * 3600)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "osworld_local.json")
    ap.add_argument("--reuse", action="store_true", help="keep an existing copy (see the module docstring)")
    a = ap.parse_args()

    p = load_params(ROOT / "params.yaml", a.overrides, preset=a.preset)  # a bad override fails here
    preset_file = Path("presets") / f"{a.preset}.yaml"
    code: dict = {}
    if a.reuse and (a.work / "params.yaml").is_file():
        project = a.work
        shutil.copyfile(ROOT / preset_file, project / preset_file)
        code["preset_refreshed_from"] = source_state()
    else:
        shutil.rmtree(a.work, ignore_errors=True)
        project = copy_project(a.work)
    cmd = [str(VENV_BIN / "arpo"), "run", "--preset", a.preset, "--target", "evaluate"]
    for o in a.overrides:
        cmd += ["-S", o]
    t0 = time.monotonic()
    log = project / "run.log"
    with log.open("w") as fh:
        rc = subprocess.run(
            cmd, cwd=project, env=child_env(project), stdout=fh, stderr=subprocess.STDOUT, timeout=a.timeout
        ).returncode
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    source = project / SOURCE
    code = {"copy_of": json.loads(source.read_text()) if source.is_file() else None, **code}
    if rc:
        sys.exit(f"{' '.join(cmd)} failed (rc {rc}) in {project}; log tail:\n{text[-3000:]}")

    method = "arpo" if p.train.replay.enabled else "grpo"
    modes = ["greedy"] + (["sampled"] if p.evaluate.sampled_temperature else [])
    episodes = {
        (name, mode): read_trajectories(
            project / "data" / "eval" / (name + ("" if mode == "greedy" else f"-{mode}") + ".parquet")
        )
        for name in ("base", method)
        for mode in modes
    }
    base, trained = episodes["base", "greedy"], episodes[method, "greedy"]
    demos = read_trajectories(project / "data" / "demos")
    baseline = read_trajectories(project / "data" / "baseline")
    select = json.loads((project / "metrics" / "select.json").read_text())
    train = json.loads((project / "metrics" / "train.json").read_text())
    sft = json.loads((project / "metrics" / "sft.json").read_text())
    doc = {
        "benchmark": "osworld_local_pipeline",
        "command": "python benchmarks/osworld_local.py"
        + "".join(f" -S {o}" for o in a.overrides)
        + (" --reuse" if a.reuse else "")
        + f"  (runs: arpo run --preset {a.preset} --target evaluate in a project copy)",
        "code": code,
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, "
        f"torch {__import__('torch').__version__}",
        "preset": f"presets/{a.preset}.yaml (env.kind {p.env.kind}, provider {p.env.osworld.provider}, "
        f"{p.env.osworld.screen_width}x{p.env.osworld.screen_height}, {p.env.n_envs} envs)",
        "suite": {
            "in_domain": p.env.in_domain_suite,
            "out_of_domain": p.env.out_of_domain_suite,
            "tasks": len({(t.task_domain, t.task_id) for t in base}),
        },
        "episodes_per_task": p.evaluate.episodes_per_task,
        "scoring": f"greedy (evaluate.temperature {p.evaluate.temperature}), evaluate.max_steps "
        f"{p.evaluate.max_steps}, OSWorld scoring; format error = an episode with a reply that did not parse",
        "base": summary(base, Scorer.of(p.evaluate.osworld_hard, p.evaluate.max_steps)),
        method: summary(trained, Scorer.of(p.evaluate.osworld_hard, p.evaluate.max_steps)),
        f"{method}_minus_base": {
            mode: paired_difference(
                episodes["base", mode],
                episodes[method, mode],
                Scorer.of(p.evaluate.osworld_hard, p.evaluate.max_steps),
            )
            for mode in modes
        },
        "sampled": {
            "temperature": p.evaluate.sampled_temperature,
            "base": summary(
                episodes["base", "sampled"], Scorer.of(p.evaluate.osworld_hard, p.evaluate.max_steps)
            ),
            method: summary(
                episodes[method, "sampled"], Scorer.of(p.evaluate.osworld_hard, p.evaluate.max_steps)
            ),
        }
        if "sampled" in modes
        else None,
        "pipeline": {
            "wall_s": round(wall),
            "stage_wall_s": stage_times(project, p.project.name),
            "demos_episodes": len(demos),
            "sft": {k: sft[k] for k in sorted(sft)},
            "baseline_episodes": len(baseline),
            "baseline_success_rate": sum(t.success for t in baseline) / max(1, len(baseline)),
            "select": select,
            "train": {k: v for k, v in sorted(train.items()) if k.startswith(("rollout/", "replay/"))},
        },
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    b, m = doc["base"], doc[method]
    print(
        f"base: success {b['success']:.3f}, format errors {b['format_error_rate']:.3f}; {method}: success "
        f"{m['success']:.3f}, format errors {m['format_error_rate']:.3f}  ({wall / 60:.0f} min) -> {a.out}"
    )


if __name__ == "__main__":
    main()
