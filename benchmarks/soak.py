"""Soak of the whole quick pipeline (issue 18 item 8): `arpo run --preset quick` in a copy of the project
while a background thread SIGKILLs a random env-pool worker or its browser every few seconds.

Two runs of the same params in two fresh copies: a reference run with no kills, then the soaked run.
Rollouts are reproducible (an episode's seed comes from the run seed, epoch, job and step, never from
timing), so every episode the reference stored must be stored by the soaked run too, once:
- episodes lost = reference episodes missing from the soaked run's Parquet files (keyed by file, stage,
  epoch, task, group and sample), extra = the other way round;
- every kill must be counted: at least one of the run's own warning lines (one per fault, pool.py,
  decision "Fault counting"; the way a user sees them) names the killed worker: a killed worker is found by
  its next call, a failed start or the pool's close, and replaced; a killed browser is found by the next step
  (fatal), by the reset that replaces it, or by the env when the pool closes it.

Only pool processes are killed: env workers (their own process group, a private `arpo-envworker-` temp
dir) and their browsers (chromedriver and the main Chromium process), found among the descendants of
the `arpo run` process this script started; one kill per worker life. Writes benchmarks/results/soak.json.

    .venv/bin/python benchmarks/soak.py --kill-every 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.infra.fileio import atomic_write_json  # noqa: E402
from arpo_core.trajectory import read_trajectories  # noqa: E402

VENV_BIN = Path(sys.executable).parent
FAULT_LINE = re.compile(
    r"(?:(\d\d:\d\d:\d\d\.\d{3}) .*?)?env fault (\w+): env (\d+), task (\S+), worker (\S+): (.*)"
)
"""A pool fault line (pool.py, decision "Fault counting") in the run log: time, kind, env, task, worker pid,
message."""


# ------------------------------------------------------------------------------------------- processes
def _proc_table() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (ppid, pgrp, cmdline) of every live (non-zombie) process."""
    out = {}
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            fields = Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{e}/cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(e)] = (int(fields[1]), int(fields[2]), cmd)
    return out


def _is_worker(cmdline: bytes) -> bool:
    """`python -c <boot> FD PARENT_PID TMPDIR` (pool.py ProcessWorker.start). Not a Chromium process that
    leads a group of its own (its zygote) and names the worker's temp dir in its profile path."""
    args = cmdline.split(b"\0")
    return len(args) >= 5 and args[1] == b"-c" and b"/arpo-envworker-" in args[-1] + args[-2]


def pool_targets(root: int, table: dict[int, tuple[int, int, bytes]] | None = None) -> dict[int, list[int]]:
    """{env worker pid: its browser pids} among the descendants of `root`.

    A worker leads its own process group and names its private `arpo-envworker-` temp dir on its command
    line (pool.py ProcessWorker.start); its browser is its chromedriver and the main Chromium process
    below it (killing both is a browser crash), listed only while that main process runs: a browser the
    env has already quit is no target. Nothing else (the Prefect server, the trainer, the worker's
    reaper, Chromium's zygotes and crash handlers) is ever a target.
    """
    table = _proc_table() if table is None else table
    children = collections.defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    desc, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in desc:
                desc.add(c)
                todo.append(c)
    workers = [p for p in desc if table[p][1] == p and _is_worker(table[p][2])]
    out = {}
    for w in workers:
        drivers = [p for p in desc if table[p][1] == w and b"chromedriver" in table[p][2].split(b"\0")[0]]
        mains = [
            p
            for p in desc
            if table[p][0] in drivers and b"chrom" in table[p][2] and b"--type=" not in table[p][2]
        ]
        out[w] = sorted(drivers + mains) if mains else []
    return out


def killer(root: int, stop: threading.Event, every_s: float, seed: int, log: list) -> None:
    """Every `every_s`: SIGKILL a random live worker, or all browser processes of one (one kill per worker)."""
    rng = random.Random(seed)
    hit: set[int] = set()
    while not stop.wait(every_s):
        targets = {w: b for w, b in pool_targets(root).items() if w not in hit}
        if not targets:
            continue
        worker = rng.choice(sorted(targets))
        browsers = targets[worker]
        what = "worker" if rng.random() < 0.5 or not browsers else "browser"
        try:
            for pid in [worker] if what == "worker" else browsers:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        hit.add(worker)
        now = time.time()
        at = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        log.append({"at": at, "what": what, "worker": worker})


# ------------------------------------------------------------------------------------------------ runs
def copy_project(dst: Path) -> Path:
    """The files git knows (tracked or not ignored) copied into `dst`: a project with no outputs."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    atomic_write_json(dst / SOURCE, source_state(), indent=1)
    return dst


SOURCE = ".arpo/source.json"
"""Where `copy_project` records the code a copy was made from (`source_state`)."""


def source_state() -> dict:
    """The checkout's commit and the paths that differed from it (uncommitted or untracked)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    dirty = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty": dirty}


def child_env(project: Path) -> dict[str, str]:
    """The environment of an `arpo run` in project copy `project`: this venv first on PATH, the copy's
    own code first on the import path (the venv's editable install points at this checkout, which may
    change while the run goes on), Prefect's home and MLflow's store inside the copy (no server of the
    caller's), no telemetry."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(project),
        PREFECT_HOME=str(project / ".prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_DISABLE_TELEMETRY="true",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_pipeline(project: Path, preset: str, kill_every: float | None, seed: int, timeout_s: float) -> dict:
    env = child_env(project)
    log_path = project / "soak_run.log"
    kills: list = []
    stop = threading.Event()
    t0 = time.monotonic()
    with log_path.open("w") as fh:
        proc = subprocess.Popen(
            [str(VENV_BIN / "arpo"), "run", "--preset", preset],
            cwd=project,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        th = None
        if kill_every:
            th = threading.Thread(target=killer, args=(proc.pid, stop, kill_every, seed, kills), daemon=True)
            th.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            stop.set()
            if th is not None:
                th.join()
    text = log_path.read_text(errors="replace")
    faults = [m.groups() for m in map(FAULT_LINE.search, text.splitlines()) if m]
    return {
        "rc": rc,
        "wall_s": round(time.monotonic() - t0, 1),
        "kills": kills,
        "faults": faults,
        "episodes": stored_episodes(project),
        "log_tail": text[-2000:] if rc else "",
    }


def stored_episodes(project: Path) -> dict[tuple, str]:
    """(file, stage, epoch, domain, task, group, sample, replayed) -> the episode's replies, for every
    trajectory in every Parquet file the run wrote (outside MLflow's artifact store, which holds copies)."""
    out = {}
    for f in sorted(project.rglob("*.parquet")):
        # Replay items files are named by a hash that includes the run's id: compare them by folder.
        rel = re.sub(r"items-[0-9a-f]+\.parquet$", "items-*.parquet", str(f.relative_to(project)))
        if rel.startswith("mlruns/"):  # MLflow's copies of the same files, under per-run ids
            continue
        for t in read_trajectories(f):
            key = (rel, t.stage, t.epoch, t.task_domain, t.task_id, t.group_id, t.sample_idx, t.replayed)
            out[key] = "\n".join(s.response_text for s in t.steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--kill-every", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--workdir", default="/tmp/arpo-soak")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    a = ap.parse_args()

    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    ref = run_pipeline(copy_project(work / "reference"), a.preset, None, a.seed, a.timeout)
    soak = run_pipeline(copy_project(work / "soaked"), a.preset, a.kill_every, a.seed, a.timeout)

    faults = soak["faults"]
    kinds = collections.Counter(f[1] for f in faults)
    closed_dead = sum(f[1] == "worker_crashes" and "found when the pool closed" in f[5] for f in faults)
    # A kill is noticed when a fault line names the killed worker: its replacement, or its death found by a
    # call, a failed start or the pool's close.
    named = {f[4] for f in faults}
    unnoticed = [k for k in soak["kills"] if str(k["worker"]) not in named]
    noticed = len(soak["kills"]) - len(unnoticed)
    ref_keys, soak_keys = set(ref["episodes"]), set(soak["episodes"])
    same = sum(ref["episodes"][k] == soak["episodes"][k] for k in ref_keys & soak_keys)
    per_file = collections.Counter(k[0] for k in ref_keys)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    doc = {
        "benchmark": "soak of the whole pipeline (arpo run --preset quick)",
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "commit": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{os.cpu_count()} cores",
        "kill_every_s": a.kill_every,
        "reference_run": {"rc": ref["rc"], "wall_s": ref["wall_s"], "faults": len(ref["faults"])},
        "soaked_run": {"rc": soak["rc"], "wall_s": soak["wall_s"]},
        "kills": len(soak["kills"]),
        "kills_by_kind": dict(collections.Counter(k["what"] for k in soak["kills"])),
        "faults_counted": dict(kinds),
        "fault_lines_by_task": dict(collections.Counter(f[3] for f in faults)),
        "workers_found_dead_at_close": closed_dead,
        "kills_noticed": noticed,
        "kills_equal_kills_noticed": not unnoticed,
        "kills_unnoticed": unnoticed,
        "kill_log": soak["kills"],
        "episodes_expected": len(ref_keys),
        "episodes_expected_by_file": dict(sorted(per_file.items())),
        "episodes_stored": len(soak_keys),
        "episodes_lost": len(ref_keys - soak_keys),
        "episodes_extra": len(soak_keys - ref_keys),
        "episodes_identical_to_reference": same,
        "lost_examples": [list(k) for k in sorted(ref_keys - soak_keys)[:5]],
    }
    if ref["rc"] or soak["rc"]:
        doc["log_tails"] = {"reference": ref["log_tail"], "soaked": soak["log_tail"]}
    atomic_write_json(a.out, doc, indent=1)
    print(json.dumps(doc, indent=1))
    sys.exit(0 if not (ref["rc"] or soak["rc"]) else 1)


if __name__ == "__main__":
    main()
