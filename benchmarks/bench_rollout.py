"""Rollout throughput, step-synchronous vs asynchronous: env steps/s, episodes/s and env utilization of
`run_episodes` with 4, 8, 16 parallel MiniWoB envs in `sync` and `async` mode (rollout.py,
decision "Sync and async schedules"), batched inference on a real tiny policy; wall time split into env /
inference / overhead.

Run from the repository root:

    .venv/bin/python benchmarks/bench_rollout.py            # writes benchmarks/results/rollout.json
    .venv/bin/python benchmarks/bench_rollout.py --envs 2 --episodes 4 --repeats 1 \\
        --out /tmp/rollout.json                             # a short check

Decisions:
- **Real tiny policy.** The policy is a real tiny Qwen2.5-VL (`build_tiny_policy(size='xs', rope_theta=5.0,
  mrope=[2,7,7])` in a temp dir, or `--policy DIR`) run by `HFGenerator`: inference cost is the real batched
  generation. Its replies are random text, which would end every episode at step 1 as a format error
  (no env step at all), so the generator wrapper keeps the sampled tokens and their cost but replaces
  the reply TEXT with a random `click(start_box=...)` inside the model image, drawn from the reply's
  own sampling seed (rollout.py, decision "Per-step sampling seeds": the same job list gives the same clicks
  in every mode and pool size; the record checks that both modes produced the same trajectories). Episodes
  therefore run to `--max-steps` or to the task's own end, as a trained policy's would.
- **Fixed reply length.** Every reply has exactly `--reply-tokens` tokens (the stop tokens, and all other
  special tokens, are masked out as in bench_generation.py), so inference cost does not depend on when a
  random model happens to stop.
- **Modes.** Modes: `sync` and `async` are `run_episodes`' two schedules on the same pool and the same jobs,
  one after the other for each pool size (so both see the same machine load); `--batch-wait` is async's
  `batch_wait_s`. `--one-at-a-time` splits every batch into batch-1 calls (a non-batched baseline).
- **Loop timings.** Timings come from `run_episodes` metrics: `time/env_wait_s` (the loop blocked on env
  calls), `time/inference_s` (generate calls), `time/other_s` (parsing, PNG encoding, prompts, bookkeeping),
  `rollout/env_utilization` (each env's busy time in resets/steps/evaluations, i.e. the pool's
  `EnvResult.elapsed_s`, over n_envs x wall time). A pool proxy (`TimedPool`) adds the latency of each
  reset / step / evaluate call. One warm-up episode per env runs before the timed repeats (Chromium
  and the page cache warm up); pool start time is reported separately. Medians over `--repeats`.
- **One torch thread.** torch uses one thread (params.yaml project.torch_threads; on a busy 2-core machine
  more threads spin), and the load average before/after is recorded because other jobs lower the numbers.
- **Machine CPU busy.** `machine_cpu_busy`: the fraction of all cores' time that was busy during the run
  (/proc/stat), whoever used it (Chromium, the workers, the generator). Async can only win the CPU time that
  sync leaves idle (its envs waiting for the generator, the generator waiting for the slowest env): on a
  machine whose cores are already busy under sync, async cannot be much faster, whatever its schedule.
- **Step pauses.** `--step-pauses`: each value is a run of every pool size and mode with envs that sleep that
  long after each step's actions (MiniWoBEnv `step_pause_s`, miniwob_env.py, decision "Step pause"), i.e. envs
  whose step time is partly waiting, as an OSWorld VM on another host is (OSWorld's
  `DesktopEnv.step(pause=...)`; this project's local desktop pauses `env.osworld.settle_s` = 0.5 s). With
  pause 0 MiniWoB's step time is this machine's CPU (Chromium), which the generator competes for. Ratios of a
  pause p > 0 carry the suffix `_pause<p>`.
- **Pipeline prompt.** The generator's prompts use params.yaml's `policy.system_prompt` and
  `policy.history_images` (the pipeline's own prompt; `--history-images all` keeps every screenshot, as
  presets/paper.yaml does).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from arpo_core.policy.prompt import PromptSpec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generation import NoStop  # noqa: E402

from arpo_core.actions import smart_resize  # noqa: E402
from arpo_core.algorithm.rollout import ROLLOUT_MODES, EpisodeJob, RolloutConfig, run_episodes  # noqa: E402
from arpo_core.config import load_params  # noqa: E402
from arpo_core.envs.base import TaskSpec  # noqa: E402
from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env  # noqa: E402
from arpo_core.envs.pool import EnvPool  # noqa: E402
from arpo_core.infra.fileio import atomic_write_json  # noqa: E402
from arpo_core.policy.generate import Generation  # noqa: E402
from arpo_core.policy.prompt import PromptInput  # noqa: E402

TASKS = ("click-test", "click-button", "click-link", "click-dialog")
"""In-domain click tasks (data/suites/miniwob_in_domain.yaml)."""


class FixedLengthGenerator(NoStop):
    """HFGenerator whose replies always have `max_new_tokens` tokens (decision "Fixed reply length") and never
    contain a special token: a random policy samples `<|image_pad|>` now and then, and that id fed back as
    reply history breaks the next prompt's image-token count (get_rope_index raises StopIteration)."""

    def banned_ids(self) -> list[int]:
        return sorted(self.policy.tokenizer.added_tokens_decoder)  # every special/added token id


class ClickingGenerator:
    """Real generation, reply text replaced by a random click in model-image pixels drawn from the
    prompt's own seed (decision "Real tiny policy").

    `one_at_a_time` splits each batch into batch-1 calls (decision "Modes"). `batch_sizes` records the size
    of every batch the rollout loop asked for."""

    def __init__(self, inner, min_pixels: int, max_pixels: int, one_at_a_time: bool = False):
        self.inner = inner
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.one_at_a_time = one_at_a_time
        self.batch_sizes: list[int] = []

    def click_text(self, prompt: PromptInput, seed: int) -> str:
        w, h = prompt.screenshots[-1].size
        mh, mw = smart_resize(h, w, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        rng = random.Random(seed)
        x, y = rng.randrange(mw), rng.randrange(mh)
        return f"Thought: try here\nAction: click(start_box='({x},{y})')"

    def generate(self, batch: list[PromptInput], *, seeds, **kw) -> list[Generation]:
        self.batch_sizes.append(len(batch))
        if self.one_at_a_time:
            gens = [self.inner.generate([p], seeds=[s], **kw)[0] for p, s in zip(batch, seeds, strict=True)]
        else:
            gens = self.inner.generate(batch, seeds=seeds, **kw)
        return [
            Generation(self.click_text(p, s), g.token_ids, g.logprobs, g.finish_reason)
            for p, s, g in zip(batch, seeds, gens, strict=True)
        ]


class TimedPool:
    """EnvPool proxy that records each call's latency (submit -> result ready) by kind. It returns the
    pool's own futures (the loop waits on them with concurrent.futures.wait)."""

    def __init__(self, pool: EnvPool):
        self.pool = pool
        self.n = pool.n
        self.latency: dict[str, list[float]] = {"reset": [], "step": [], "evaluate": []}

    def _timed(self, kind: str, fut):
        t0 = time.monotonic()
        fut.add_done_callback(lambda _f: self.latency[kind].append(time.monotonic() - t0))
        return fut

    def submit_reset(self, *a):
        return self._timed("reset", self.pool.submit_reset(*a))

    def submit_step(self, *a):
        return self._timed("step", self.pool.submit_step(*a))

    def submit_evaluate(self, *a):
        return self._timed("evaluate", self.pool.submit_evaluate(*a))

    def fault_counts(self):
        return self.pool.fault_counts()

    def task_fault_counts(self):
        return self.pool.task_fault_counts()


def make_jobs(tasks: Sequence[str], episodes: int, first_seed: int) -> list[EpisodeJob]:
    """`episodes` jobs cycling over `tasks`, each with its own env seed."""
    return [
        EpisodeJob(
            TaskSpec("miniwob", tasks[i % len(tasks)], split="in_domain", backend="miniwob"), first_seed + i
        )
        for i in range(episodes)
    ]


def summarize(metrics: dict[str, float], n_steps: int, n_episodes: int) -> dict[str, float]:
    """Throughput and wall-time shares of one `run_episodes` call."""
    wall = metrics["time/rollout_s"]
    return {
        "wall_s": wall,
        "env_steps": n_steps,
        "episodes": n_episodes,
        "env_steps_per_s": n_steps / wall,
        "episodes_per_s": n_episodes / wall,
        "env_s": metrics["time/env_wait_s"],
        "inference_s": metrics["time/inference_s"],
        "other_s": metrics["time/other_s"],
        "env_frac": metrics["time/env_wait_s"] / wall,
        "inference_frac": metrics["time/inference_s"] / wall,
        "other_frac": metrics["time/other_s"] / wall,
        "env_utilization": metrics["rollout/env_utilization"],
        "mean_batch": metrics["rollout/mean_batch"],
        "generate_calls": metrics["rollout/generate_calls"],
    }


def median_summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise median of several `summarize` outputs, rounded for the results file."""
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is no /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def cpu_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """Fraction of the machine's CPU time (all cores) that was busy between two `cpu_times`
    (decision "Machine CPU busy")."""
    if before is None or after is None or after[1] == before[1]:
        return float("nan")
    return round((after[0] - before[0]) / (after[1] - before[1]), 4)


def bench_pool(policy, backend: str, n: int, args, cfg: RolloutConfig, pause: float = 0.0) -> list[dict]:
    """Every mode of `args.modes` on one pool of `n` envs, the same jobs each (decision "Modes"); the envs
    sleep `pause` seconds after each step's actions (decision "Step pauses")."""
    gen = ClickingGenerator(
        FixedLengthGenerator(policy, spec=PromptSpec.of(args)),
        cfg.min_pixels,
        cfg.max_pixels,
        one_at_a_time=args.one_at_a_time,
    )
    kw = {"ray_resources": {"env_node": 0.01}} if backend == "ray" else {}
    t0 = time.perf_counter()
    pool = EnvPool(functools.partial(make_miniwob_env, step_pause_s=pause), n, backend=backend, **kw)
    start_s = time.perf_counter() - t0
    out = []
    try:
        warm = run_episodes(pool, gen, make_jobs(args.tasks, n, 10_000), cfg)  # decision "Loop timings"
        assert not warm.failed, warm.failed
        per_mode: dict[str, list[dict]] = {m: [] for m in args.modes}
        sigs: dict[str, list] = {m: [] for m in args.modes}
        faults = dict.fromkeys(args.modes, 0)
        for rep in range(args.repeats):
            jobs = make_jobs(args.tasks, args.episodes, 1000 * rep)
            for mode in args.modes:  # interleaved, so both modes see the same load
                mcfg = dataclasses.replace(cfg, mode=mode, batch_wait_s=args.batch_wait)
                timed = TimedPool(pool)
                cpu0 = cpu_times()
                res = run_episodes(timed, gen, jobs, mcfg, epoch=rep)
                cpu1 = cpu_times()
                faults[mode] += len(res.failed) + int(res.metrics["rollout/env_faults"])
                sigs[mode].append([[st.response_text for st in t.steps] for t in res.trajectories])
                steps = sum(len(t.steps) for t in res.trajectories)
                s = summarize(res.metrics, steps, len(res.trajectories))
                s["machine_cpu_busy"] = cpu_busy(cpu0, cpu1)
                for kind, lat in timed.latency.items():
                    s[f"{kind}_calls"] = len(lat)
                    s[f"{kind}_ms_mean"] = 1000 * statistics.mean(lat) if lat else 0.0
                per_mode[mode].append(s)
    finally:
        pool.close()
    for mode, runs in per_mode.items():
        row = {
            "backend": backend,
            "n_envs": n,
            "mode": mode,
            "step_pause_s": pause,
            "pool_start_s": round(start_s, 2),
        }
        if mode == "async":
            row["batch_wait_s"] = args.batch_wait
        row.update(median_summary(runs))
        row["env_steps_per_s_runs"] = [round(r["env_steps_per_s"], 3) for r in runs]
        row["env_faults"] = faults[mode]
        row["same_trajectories_as_first_mode"] = sigs[mode] == sigs[args.modes[0]]
        out.append(row)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    strs = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--envs", type=ints, default=[4, 8, 16], help="pool sizes, comma-separated")
    ap.add_argument(
        "--step-pauses",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0],
        help='env step_pause_s values, comma-separated (decision "Step pauses")',
    )
    ap.add_argument("--backends", type=strs, default=["process"])
    ap.add_argument("--modes", type=strs, default=["sync", "async"], help='rollout modes (decision "Modes")')
    ap.add_argument("--batch-wait", type=float, default=0.0, help="async batch_wait_s")
    ap.add_argument("--one-at-a-time", action="store_true", help='batch-1 generate calls (decision "Modes")')
    ap.add_argument("--episodes", type=int, default=16, help="episodes per timed run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--reply-tokens", type=int, default=32, help="tokens per reply (forced)")
    ap.add_argument("--tasks", type=strs, default=list(TASKS))
    ap.add_argument("--policy", type=Path, default=None, help="policy dir (default: build tiny xs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    params = load_params(ROOT / "params.yaml").policy
    ap.add_argument(
        "--history-images",
        type=lambda v: None if v == "all" else int(v),
        default=params.history_images,
        help='screenshots per prompt (decision "Pipeline prompt"; '
        "'all': every step's); default: params.yaml's",
    )
    ap.add_argument("--system-prompt", default=params.system_prompt, help="default: params.yaml's")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout.json"))
    args = ap.parse_args(argv)
    for b in args.backends:
        if b not in ("process", "ray"):
            ap.error(f"unknown backend {b!r}")
    for m in args.modes:
        if m not in ROLLOUT_MODES:
            ap.error(f"unknown mode {m!r} (expected one of {', '.join(ROLLOUT_MODES)})")
    return args


def ratios(results: list[dict]) -> dict[str, float]:
    """async / sync env steps/s and env utilization per (backend, n); `async_over_sync_<n>` for the
    process backend (the issue's headline: n = 8)."""
    by = {(r["backend"], r.get("step_pause_s", 0.0), r["n_envs"], r["mode"]): r for r in results}
    out: dict[str, float] = {}
    for (b, pause, n, m), r in sorted(by.items()):
        if m != "async" or (b, pause, n, "sync") not in by:
            continue
        sync = by[(b, pause, n, "sync")]
        prefix = "" if b == "process" else f"{b}_"
        suffix = f"_pause{pause:g}" if pause else ""
        out[f"{prefix}async_over_sync_{n}{suffix}"] = round(r["env_steps_per_s"] / sync["env_steps_per_s"], 3)
        out[f"{prefix}utilization_async_{n}{suffix}"] = r["env_utilization"]
        out[f"{prefix}utilization_sync_{n}{suffix}"] = sync["env_utilization"]
    return out


def bounds(results: list[dict]) -> dict[str, float]:
    """What async could win over each sync run, from the sync run's own numbers (decision "Machine CPU busy"):
    `cpu_bound_<n>[_pause<p>]` = 1 / machine_cpu_busy, the most async can gain while doing the same CPU
    work per step (it does more: smaller generation batches), and `gen_hidden_<n>[_pause<p>]` =
    1 / (1 - inference share of sync's wall time), the gain from hiding sync's generation behind env
    steps alone (async also stops waiting for the slowest env of a round, which this leaves out)."""
    out: dict[str, float] = {}
    for r in results:
        if r["mode"] != "sync" or r["backend"] != "process":
            continue
        pause = r.get("step_pause_s", 0.0)
        key = f"{r['n_envs']}{f'_pause{pause:g}' if pause else ''}"
        if r.get("machine_cpu_busy") == r.get("machine_cpu_busy"):  # not NaN
            out[f"cpu_bound_{key}"] = round(1.0 / max(r["machine_cpu_busy"], 1e-9), 3)
        out[f"gen_hidden_{key}"] = round(1.0 / max(1e-9, 1.0 - r["inference_frac"]), 3)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = [round(x, 2) for x in os.getloadavg()]
    from arpo_core.policy.model import build_tiny_policy, load_policy

    with tempfile.TemporaryDirectory() as tmp:
        if args.policy is None:
            policy = build_tiny_policy(Path(tmp) / "policy", size="xs", rope_theta=5.0, mrope=[2, 7, 7])
            policy_desc = "build_tiny_policy(size='xs', rope_theta=5.0, mrope=[2, 7, 7])"
        else:
            policy, policy_desc = load_policy(args.policy), str(args.policy)
        n_params = sum(p.numel() for p in policy.model.parameters())
        ip = policy.processor.image_processor
        cfg = RolloutConfig(
            max_steps=args.max_steps,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=args.reply_tokens,
            format_penalty=-1.0,
            min_pixels=ip.size["shortest_edge"],
            max_pixels=ip.size["longest_edge"],
            coord_mode="absolute",
            seed=0,
        )
        results = []
        for backend in args.backends:
            if backend == "ray":
                import ray

                ray.init(
                    num_cpus=os.cpu_count(),
                    include_dashboard=False,
                    log_to_driver=False,
                    resources={"env_node": 1.0},
                )
            try:
                for pause in args.step_pauses:
                    for n in args.envs:
                        for r in bench_pool(policy, backend, n, args, cfg, pause):
                            print(json.dumps(r), flush=True)
                            results.append(r)
            finally:
                if backend == "ray":
                    ray.shutdown()
    record = {
        "benchmark": "rollout",
        "command": "python benchmarks/bench_rollout.py "
        + " ".join(
            [
                "--envs",
                ",".join(map(str, args.envs)),
                "--step-pauses",
                ",".join(f"{x:g}" for x in args.step_pauses),
                "--backends",
                ",".join(args.backends),
                "--modes",
                ",".join(args.modes),
                "--batch-wait",
                str(args.batch_wait),
                "--episodes",
                str(args.episodes),
                "--repeats",
                str(args.repeats),
                "--max-steps",
                str(args.max_steps),
                "--reply-tokens",
                str(args.reply_tokens),
                "--tasks",
                ",".join(args.tasks),
                "--threads",
                str(args.threads),
                "--history-images",
                "all" if args.history_images is None else str(args.history_images),
                "--system-prompt",
                args.system_prompt,
            ]
            + (["--policy", str(args.policy)] if args.policy else [])
            + (["--one-at-a-time"] if args.one_at_a_time else [])
        ),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": args.threads,
            "cpu_count": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "policy": {
            "source": policy_desc,
            "parameters": n_params,
            "reply_tokens": args.reply_tokens,
            "system_prompt": args.system_prompt,
            "history_images": args.history_images,
        },
        "tasks": args.tasks,
        "episode": f"max {args.max_steps} steps; each step a seeded random click in the model image",
        "results": results,
        "ratios": ratios(results),
        "bounds": bounds(results),
    }
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
