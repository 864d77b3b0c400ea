"""Stage `ground`: grounding pretraining ("click the named target" on synthetic and real MiniWoB
screens), or the project's versioned grounded tiny policy, measured for image dependence.

Decisions:
- **Grounding start.** `ground` turns the start policy into `models/grounded`, the start of `sft`. The start
  is `ground.checkpoint` (the versioned grounded tiny policy) or, when that is null, `models/init`;
  `ground.phases` then train it in order (a phase may first grow the LM's or the tower's depth, `grown`).
  With no phases the start is copied file by file, so the output is that checkpoint bit for bit. A
  pretrained model from `init_policy` (a pointer in `models/init`) wins over `ground.checkpoint`, which is a
  tiny model: with no phases the pointer is passed on unmeasured (a 7B model's greedy clicks on hundreds of
  screens are hours of CPU, and UI-TARS is grounded by its own pretraining); with phases it is trained and
  saved like any other start.
- **Image dependence measured.** `ground` always measures image dependence of its output on held-out screens
  (docs/method.md §7): synthetic levels drawn with seed 10000 + the level's index in `grounding.LEVELS` (fixed
  per level, other streams than training's, which seeds each phase with its own small `seed`) and real MiniWoB
  screens of the in-domain tasks with env seeds from 1000. Seeds 1000-1999 are held out whatever the
  phases ask: training's N screens are env seeds 0..N-1 skipping that block (`training_seeds`: 0-999, then
  2000..), so no count of real screens trains on a held-out one. One browser reads every real screen the
  stage needs and is closed before training starts; a screen read once is kept on disk
  (`ground.screen_cache`; envs/miniwob/screens.py, decision "Screen cache"), so a resumed stage, a
  snapshot or a re-measure reads it from there and starts no browser when all are kept. The measures
  are the stage's metrics (`ground/<level>/hit_rate`, ...) and, with the recipe and the loss curves,
  `ground_report.json` inside the checkpoint directory, so the model carries how it was made and how it
  scores. These final measures click as the policy will act, with `policy.click_readout` (generate.py,
  decision "Read clicks"); the curves while a phase trains read the written digits. A start that carries
  its own report (a versioned checkpoint the stage trained: its recipe, commit and curves) has it kept
  whole in the new report's `start_report`, so the chain of how a policy was made survives copies and
  further phases. Each phase's entry gives its depths (`layers`, `vision_blocks`), the tower's width
  (`vision_width`) and, where it grew either, every layer's and block's output-projection norms at its
  end (`output_norms`, `policy.model.output_norms`): whether what it grew engaged, beside what was there.
- **Staged output.** The stage writes only into `out_dir`, which the runner hands it as a staging directory
  swapped in on success (flows/runner.py, decision "Staged outputs"): a failed copy or training run leaves the
  previous `models/grounded` as it was. Copies of the versioned checkpoint go through `fileio.copy_tree`
  (space checked first; a full disk is one line saying what, where, MB needed and free), policies through
  `Policy.save` (the same for the weights).
- **Resumable phases.** Each phase checkpoints its whole training state to `out_dir/checkpoints/phase-<i>.pt`
  every `ground.checkpoint_every_s` seconds and when it ends (grounding.py, decision "Resumable training").
  The staged output survives a failed or killed attempt with the same key, so the restarted stage passes
  finished phases at once and continues the interrupted one to the same weights; a run of hours loses
  minutes to a kill. The key holds the stage's code: restarted after a change to it (or to its params),
  the stage starts over and the runner sets the checkpoints aside, naming what changed (flows/runner.py,
  decision "Set aside, not deleted"), so keep a long run's checkout as it is until it ends. The
  checkpoints are removed when the stage succeeds.
  A phase with `carry_heads` starts its heads from the checkpoint of the phase before it (grounding.py,
  decision "Carried heads").
- **Pixel budget.** `ground.min_pixels` sets the grounded policy's pixel floor (its image processor's
  `size.shortest_edge`, the ceiling raised to it where it is below): the start's weights are loaded at
  that scale, trained and measured there, and saved with it, so demos, cloning, rollouts and evaluation
  see the screens as the grounding did. Nothing in the weights depends on the number of visual tokens
  (patches, M-RoPE positions and the click's pixels all follow the image), so a 1x reader continues at
  2x; its clicks, in the bigger image's pixels, are relearned. With no phases the start is saved at the
  new scale rather than copied.
- **Curves while it trains.** A phase with `eval_every` > 0 measures, every that many steps, the held-out
  screens of its own levels (the same screens as the final measures) and the held-out real screens; each
  measurement goes to `on_metrics` at the stage-wide step (the runner logs it to the stage's MLflow run as
  `iter/ground/curve/<set>/<measure>`, so an hours-long run is watched while it runs) and into the report's
  `curve`. `until_hit` ends a phase once every one of its levels' sets reaches that hit rate (the real
  screens are measured, not gated on): the curriculum advances to its next level on held-out evidence, and
  `steps` is the most a level may take (grounding.py, decision "Reading curriculum").
- **Snapshots.** An hours-long run's weights can be tried before it ends: `arpo snapshot ground --out DIR`
  (with the run's preset and overrides, in its project folder) writes the latest phase checkpoint in the
  staged output as a policy directory, without stopping or touching the run. The checkpoint must have been
  made by these params' phase (its fingerprint, grounding.py `checkpoint_fingerprint`: config, prompt and
  real screens, which are rendered again to check it), so a snapshot is never the weights of another
  recipe; a wrong pixel budget is caught where the phase has real screens (their replies' clicks are in
  the budget's pixels), not in a phase of synthetic screens only. Its `ground_report.json` says what it
  is (`snapshot`: checkpoint, phase, step, seconds) and carries every saved phase's curve and the
  checkout's commit (the run's code if the checkout has not changed since it started); it has no
  `measures`: the main job's `ground` stage measures it when `ground.checkpoint` names it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from arpo_core.config import GroundPhase, GroundSectionConfig, Params
from arpo_core.config.sections import GroundTrainConfig
from arpo_core.config.suites import families
from arpo_core.infra.fileio import atomic_write_json, atomic_write_text, copy_tree
from arpo_core.pipeline.common import suite_tasks
from arpo_core.pipeline.policies import POINTER, pixel_budget, resolve_policy, setup_torch
from arpo_core.pipeline.stage import TASK_DATA, Stage

__all__ = [
    "GROUND_REPORT",
    "STAGE",
    "ground_config",
    "ground_measure_keys",
    "held_out_screens",
    "real_screens",
    "run",
    "snapshot",
    "training_seeds",
]

# Held-out seeds of the measures (decision "Image dependence measured").
GROUND_EVAL_SEED = 10_000
MINIWOB_HELDOUT_SEED = 1000
MINIWOB_HELDOUT_SEEDS = 1000  # env seeds 1000-1999 are never trained on


def training_seeds(n: int) -> list[int]:
    """The env seeds of a phase's `miniwob_seeds` n: 0..n-1, skipping the held-out block (decision "Image
    dependence measured").

    >>> training_seeds(3), training_seeds(1002)[-3:]
    ([0, 1, 2], [999, 2000, 2001])
    """
    return [s if s < MINIWOB_HELDOUT_SEED else s + MINIWOB_HELDOUT_SEEDS for s in range(n)]


GROUND_REPORT = "ground_report.json"
CHECKPOINTS = "checkpoints"
"""Phase checkpoints, inside the staged output while the stage runs (decision "Resumable phases")."""


def ground_config(phase: GroundPhase) -> Any:
    """The `grounding.GroundConfig` of one params phase: the shared fields copied (held-out measures every
    `eval_every` steps, 0 = none during training; `until_hit`), the level weights as floats."""
    from arpo_core.offline.grounding import GroundConfig

    shared = {f.name: getattr(phase, f.name) for f in fields(GroundTrainConfig)}
    shared["mix"] = {level: float(w) for level, w in phase.mix.items()}
    return GroundConfig(**shared)


CURVE_MEASURES = (
    "hit_rate",
    "other_hit_rate",
    "corr_x",
    "corr_y",
    "parse_rate",
    "read_score",
    "name_acc",
    "point_mass",
    "point_first",
    "point_other",
    "point_even",
    "cell_hit",
    "place_row",
    "place_col",
    "match_query",
    "match_key",
    "match_pick",
    "copy_rate",
    "spell_f1",
)
"""Held-out measures a phase's curve logs per set (decision "Curves while it trains")."""


def curve_metrics(phase: int, ev: dict[str, Any]) -> dict[str, float]:
    """One in-training evaluation as the stage's progress metrics (decision "Curves while it trains").

    >>> m = curve_metrics(1, {"step": 500, "loss": 0.5, "hit_rate": 0.25, "box4/hit_rate": 0.25, "box4/n": 64})
    >>> sorted(m), m["ground/curve/box4/hit_rate"]
    (['ground/curve/box4/hit_rate', 'ground/curve/hit_rate', 'ground/curve/loss', 'ground/curve/phase'], 0.25)
    """
    out = {"ground/curve/phase": float(phase), "ground/curve/hit_rate": float(ev["hit_rate"])}
    if "loss" in ev:  # not at step 0, the start's measure
        out["ground/curve/loss"] = float(ev["loss"])
    for k, v in ev.items():
        if "/" in k and k.rsplit("/", 1)[1] in CURVE_MEASURES:
            out[f"ground/curve/{k}"] = float(v)
    return out


def ground_measure_keys(name: str, measures: dict[str, float]) -> dict[str, float]:
    """Flat metric keys of one held-out set's measures.

    >>> ground_measure_keys("box4", {"hit_rate": 0.5, "n": 64})
    {'ground/box4/hit_rate': 0.5, 'ground/box4/n': 64.0}
    """
    return {f"ground/{name}/{k}": float(v) for k, v in measures.items()}


def held_out_screens(level: str, n: int, size: tuple[int, int], read: bool = False) -> list:
    """The held-out synthetic screens of `level` (decision "Image dependence measured": seed
    GROUND_EVAL_SEED + the level's index in `grounding.LEVELS`) in the model frame `size`: the same screens
    for the stage's curves and final measures and for the grounding benchmarks; with `read`, the same
    screens as reading examples (grounding.py, decision "Reading examples")."""
    from arpo_core.offline.grounding import LEVELS, synthetic_examples

    seed = GROUND_EVAL_SEED + list(LEVELS).index(level)
    return synthetic_examples(n, {level: 1.0}, seed, size, read=read)


def source_commit(root: Path | None = None) -> dict[str, Any] | None:
    """The git commit of `root` (default: this project's code) and whether tracked files differ from it (the
    provenance a versioned checkpoint's report carries); None outside a git checkout."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30
        )
        diff = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(diff.stdout.strip())}


def _check_levels(levels: Sequence[str]) -> None:
    from arpo_core.offline.grounding import LEVELS

    unknown = sorted(set(levels) - set(LEVELS))
    if unknown:
        raise ValueError(f"ground: unknown synthetic level(s) {unknown}; levels: {', '.join(LEVELS)}")


def _miniwob_task_ids(p: Params) -> list[str]:
    tasks = suite_tasks(p, "in_domain")
    other = sorted({t.domain for t in tasks} - {"miniwob"})
    if other or p.env.kind != "miniwob":
        raise ValueError(
            f"ground: real-screen examples need MiniWoB pages, but env.kind is {p.env.kind} (in-domain "
            f"domains {sorted({t.domain for t in tasks})}): set ground.eval_miniwob_seeds and every "
            "ground.phases[].miniwob_seeds to 0"
        )
    return [t.task_id for t in families(tasks)]  # MiniWoB page names (a pinned instance's family)


def _heads_from(g: GroundSectionConfig, out_dir: Path, i: int) -> Path:
    """Where phase `i`'s carried heads start: the previous phase's checkpoint, or for the first phase the
    section's `heads_from` (grounding.py, decision "Carried heads")."""
    if i == 0:
        assert g.heads_from is not None  # the params' cross-check (GroundSectionConfig)
        return Path(g.heads_from)
    return out_dir / CHECKPOINTS / f"phase-{i - 1}.pt"


def _loss_summary(losses: Sequence[float], every: int = 50) -> list[float]:
    return [
        round(sum(losses[i : i + every]) / len(losses[i : i + every]), 4)
        for i in range(0, len(losses), every)
    ]


def real_screens(
    p: Params, size: tuple[int, int], phases: Sequence[GroundPhase] | None = None, held: bool = True
) -> tuple[dict[int, list], list]:
    """Real MiniWoB grounding examples of the in-domain tasks, all read by one browser that is closed
    before training starts: ({N: examples of env seeds 0..N-1} for the `miniwob_seeds` of every phase of
    `phases` (default: all), held-out examples of seeds 1000..1000+eval_miniwob_seeds-1 unless not `held`).
    No browser when neither is asked for, nor when `ground.screen_cache` holds every screen
    (screens.py, decision "Screen cache")."""
    from arpo_core.offline.grounding import miniwob_examples

    g = p.ground
    counts = sorted({ph.miniwob_seeds for ph in (g.phases if phases is None else phases) if ph.miniwob_seeds})
    n_held = g.eval_miniwob_seeds if held else 0
    if n_held > MINIWOB_HELDOUT_SEEDS:
        raise ValueError(
            f"ground.eval_miniwob_seeds is {n_held}: at most {MINIWOB_HELDOUT_SEEDS} held-out real screens "
            f"per task (env seeds {MINIWOB_HELDOUT_SEED}..{MINIWOB_HELDOUT_SEED + MINIWOB_HELDOUT_SEEDS - 1})"
        )
    if not counts and not n_held:
        return {}, []
    tasks = _miniwob_task_ids(p)
    from arpo_core.envs.miniwob import miniwob_env
    from arpo_core.envs.miniwob.screens import ScreenCache, render_key

    def browser():
        return miniwob_env.MiniWoBEnv(episode_time_limit_s=p.env.episode_time_limit_s)

    if g.screen_cache is None:
        env = browser()
    else:
        folder = Path(g.screen_cache) / render_key(miniwob_env.CHROMIUM_BINARY, miniwob_env.CHROMIUM_FLAGS)
        env = ScreenCache(folder, browser)
    t0 = time.perf_counter()
    try:
        train = {
            n: miniwob_examples(env, tasks, training_seeds(n), size, g.miniwob_per_screen) for n in counts
        }
        seeds = range(MINIWOB_HELDOUT_SEED, MINIWOB_HELDOUT_SEED + n_held)
        return train, miniwob_examples(env, tasks, seeds, size, g.miniwob_per_screen) if n_held else []
    finally:
        env.close()
        if isinstance(env, ScreenCache):
            print(
                f"[ground] {env.hits + env.misses} real screens in {time.perf_counter() - t0:.0f} s, "
                f"{env.hits} from {env.folder}, {env.misses} from the browser"
                + (f" ({env.damaged} kept ones were damaged)" if env.damaged else ""),
                flush=True,
            )


def _budget(start: tuple[int, int], min_pixels: int | None) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the grounded policy: the start's budget `start`, or `min_pixels` with a
    ceiling raised to it where it is below (decision "Pixel budget")."""
    lo, hi = start
    return (lo, hi) if min_pixels is None else (min_pixels, max(hi, min_pixels))


def _report_head(g: GroundSectionConfig, start: Path, code: dict[str, Any] | None) -> dict[str, Any]:
    """What every `ground_report.json` begins with: the start, the ground section, the code's commit and,
    where the start carries one, the start's own report (decision "Image dependence measured")."""
    head: dict[str, Any] = {"start": str(start), "config": asdict(g), "code": code}
    if (start / GROUND_REPORT).exists():  # how the start was made
        head["start_report"] = json.loads((start / GROUND_REPORT).read_text())
    return head


def _start(p: Params, policy_dir: Path) -> tuple[Path, tuple[int, int], tuple[int, int]]:
    """The start checkpoint (decision "Grounding start"), its pixel budget and the grounded policy's
    (decision "Pixel budget")."""
    g = p.ground
    use_init = (policy_dir / POINTER).exists() or g.checkpoint is None
    start = resolve_policy(policy_dir) if use_init else Path(g.checkpoint)
    if not (start / "config.json").exists():
        raise FileNotFoundError(f"ground: no checkpoint (config.json) at {start}")
    start_budget = pixel_budget(start)
    return start, start_budget, _budget(start_budget, g.min_pixels)


def run(
    p: Params,
    policy_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Grounding pretraining (decisions "Grounding start" and "Image dependence measured"): start policy ->
    `ground.phases` -> `out_dir` (a loadable checkpoint with `ground_report.json`); returns the held-out
    image-dependence measures. `on_metrics(step, metrics)` gets the phases' held-out curves as they are
    measured (decision "Curves while it trains")."""
    from arpo_core.offline.grounding import (
        SCREEN_H,
        SCREEN_W,
        evaluate_grounding,
        evaluate_reading,
        first_click,
        greedy_replies,
        hits_by_target,
        train_grounding,
    )
    from arpo_core.policy.model import count_parameters, grown_prefixes, load_policy, output_norms
    from arpo_core.policy.prompt import model_image_size

    setup_torch(p)
    g = p.ground
    tokens = p.policy.max_new_tokens
    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    _check_levels([lv for ph in g.phases for lv in ph.mix] + list(g.eval_levels))  # before any work
    pointer = policy_dir / POINTER
    if pointer.exists() and not g.phases:  # a pretrained model passes through (decision "Grounding start")
        atomic_write_text(out_dir / POINTER, pointer.read_text())
        return {"ground/pretrained": 1.0}
    start, start_budget, budget = _start(p, policy_dir)
    size = model_image_size(SCREEN_W, SCREEN_H, *budget)  # growing depth keeps it
    train_real, held_real = real_screens(p, size)

    metrics: dict[str, Any] = {}
    report = _report_head(g, start, source_commit()) | {"phases": []}
    done_steps = 0
    if g.phases:
        policy = load_policy(start, min_pixels=budget[0], max_pixels=budget[1])
        for i, phase in enumerate(g.phases):
            policy = grown(policy, phase)
            fixed = train_real[phase.miniwob_seeds] if phase.miniwob_seeds else None
            heldout = None
            if phase.eval_every:  # decision "Curves while it trains"
                heldout = {level: held_out_screens(level, g.eval_per_level, size) for level in phase.mix}
                if phase.read_share:  # the same screens asked to be read (grounding.py "Reading examples")
                    heldout |= {
                        f"read-{lv}": held_out_screens(lv, g.eval_per_level, size, True) for lv in phase.mix
                    }
                if len(held_real) >= 2:
                    heldout["miniwob"] = held_real

            def curve(ev: dict[str, Any], phase_i: int = i, offset: int = done_steps) -> None:
                if on_metrics is not None:
                    on_metrics(offset + ev["step"], curve_metrics(phase_i, ev))

            hist = train_grounding(
                policy,
                ground_config(phase),
                system=p.policy.system_prompt,
                max_new_tokens=tokens,
                examples=fixed,
                heldout=heldout,
                gate=list(phase.mix),  # the phase's own levels decide its until_hit
                callback=curve,
                checkpoint=out_dir / CHECKPOINTS / f"phase-{i}.pt",  # decision "Resumable phases"
                checkpoint_every_s=g.checkpoint_every_s,
                heads_from=_heads_from(g, out_dir, i) if phase.carry_heads else None,
                grown=grown_prefixes(policy, phase.grow_after or (), phase.grow_vision_after or ()),
            )
            done_steps += hist["steps"]
            losses = hist["loss"]
            head, tail = losses[: min(10, len(losses))], losses[-min(10, len(losses)) :]
            metrics[f"ground/phase{i}/loss_first"] = sum(head) / len(head)
            metrics[f"ground/phase{i}/loss_last"] = sum(tail) / len(tail)
            metrics[f"ground/phase{i}/seconds"] = hist["seconds"]
            report["phases"].append(
                {
                    "phase": i,
                    "steps": hist["steps"],
                    "seconds": round(hist["seconds"], 1),
                    "real_examples": len(fixed or ()),
                    "layers": policy.model.config.text_config.num_hidden_layers,
                    "vision_blocks": policy.model.config.vision_config.depth,
                    "vision_width": policy.model.config.vision_config.hidden_size,
                    "loss_every_50": _loss_summary(losses),
                    "stopped_at": hist.get("stopped_at"),
                    "curve": hist["evals"],
                }
                | (
                    {"output_norms": output_norms(policy)}
                    if phase.grow_after or phase.grow_vision_after
                    else {}
                )
            )
        policy.save(out_dir)
    elif budget != start_budget:  # the start's weights at another scale (decision "Pixel budget")
        policy = load_policy(start, min_pixels=budget[0], max_pixels=budget[1])
        policy.save(out_dir)
    else:  # the start as it is, bit for bit; a full disk is one line (decision "Staged output")
        copy_tree(start, out_dir, f"the grounded policy (a copy of {start})")
        policy = load_policy(out_dir)

    t0 = time.perf_counter()
    measures: dict[str, dict[str, float]] = {}
    readout = p.policy.click_readout  # clicks as the policy will act (decision "Image dependence measured")
    for level in g.eval_levels:
        exs = held_out_screens(level, g.eval_per_level, size)
        measures[level] = evaluate_grounding(
            policy, exs, system=p.policy.system_prompt, max_new_tokens=tokens, readout=readout
        ).as_dict()
    if any(ph.read_share for ph in g.phases):  # trained to read: the same screens asked to be read
        for level in g.eval_levels:
            exs = held_out_screens(level, g.eval_per_level, size, read=True)
            score = evaluate_reading(policy, exs, system=p.policy.system_prompt, max_new_tokens=tokens)
            measures[f"read-{level}"] = {"read_score": round(score, 4)}
    if g.eval_miniwob_seeds:
        if len(held_real) >= 2:  # correlations need two points
            replies = greedy_replies(
                policy, held_real, system=p.policy.system_prompt, max_new_tokens=tokens, readout=readout
            )
            clicks = [first_click(r) for r in replies]
            measures["miniwob"] = evaluate_grounding(
                policy, held_real, system=p.policy.system_prompt, max_new_tokens=tokens, clicks=clicks
            ).as_dict()
            # per task and target kind (grounding.py, decision "Real targets by kind")
            report["miniwob_targets"] = hits_by_target(held_real, replies)
            for group, m in report["miniwob_targets"].items():
                metrics[f"ground/miniwob/{group}/hit_rate"] = m["hit_rate"]
                metrics[f"ground/miniwob/{group}/copy_rate"] = m["copy_rate"]
        else:
            measures["miniwob"] = {"n": float(len(held_real))}
    for name, m in measures.items():
        metrics.update(ground_measure_keys(name, m))
    metrics["ground/eval_s"] = time.perf_counter() - t0
    metrics["ground/parameters"] = float(count_parameters(policy.model))
    metrics["ground/layers"] = float(policy.model.config.text_config.num_hidden_layers)
    metrics["ground/steps"] = float(sum(ph["steps"] for ph in report["phases"]))
    report["measures"] = measures
    atomic_write_json(out_dir / GROUND_REPORT, report, indent=1, sort_keys=True)
    # the output is the policy, not its training state
    shutil.rmtree(out_dir / CHECKPOINTS, ignore_errors=True)
    return metrics


def grown(policy: Any, phase: GroundPhase) -> Any:
    """`policy` as `phase` trains it: its language model deepened, its vision tower widened and then
    deepened by the phase's `grow_after`, `widen_vision_to` and `grow_vision_after` (policy.model.grow_depth,
    widen_vision, grow_vision_depth; the new parts drawn from the phase's seed, so a resumed run or a
    snapshot rebuilds the same ones), or as it is."""
    from arpo_core.policy.model import grow_depth, grow_vision_depth, widen_vision

    if phase.grow_after:
        policy = grow_depth(policy, phase.grow_after, seed=phase.seed)
    if phase.widen_vision_to:
        policy = widen_vision(policy, phase.widen_vision_to, seed=phase.seed)
    if phase.grow_vision_after:
        policy = grow_vision_depth(policy, phase.grow_vision_after, seed=phase.seed)
    return policy


def snapshot(
    p: Params, policy_dir: str | os.PathLike, out_dir: str | os.PathLike, dest: str | os.PathLike
) -> dict[str, Any]:
    """Decision "Snapshots": the latest phase checkpoint under the staged output `out_dir` of a running or
    interrupted stage with these params, as a policy directory `dest` (which must not exist or be empty)
    with a `ground_report.json` saying what it is; returns the report's `snapshot` entry. A missing
    checkpoint, one made by another recipe, or a `dest` in use is a ValueError naming it; nothing is
    written then."""
    import torch

    from arpo_core.offline.grounding import SCREEN_H, SCREEN_W, checkpoint_fingerprint
    from arpo_core.policy.model import load_policy
    from arpo_core.policy.prompt import model_image_size

    g = p.ground
    policy_dir, out_dir, dest = Path(policy_dir), Path(out_dir), Path(dest)
    saved = [i for i in range(len(g.phases)) if (out_dir / CHECKPOINTS / f"phase-{i}.pt").exists()]
    if not saved:
        raise ValueError(
            f"ground snapshot: no phase checkpoint in {out_dir / CHECKPOINTS}: no run of these params' "
            "phases is in progress or interrupted there (a finished stage's output is the policy itself)"
        )
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"ground snapshot: {dest} exists and is not an empty directory")
    setup_torch(p)
    i = saved[-1]
    path = out_dir / CHECKPOINTS / f"phase-{i}.pt"
    states = {j: torch.load(out_dir / CHECKPOINTS / f"phase-{j}.pt", weights_only=False) for j in saved}
    start, _, budget = _start(p, policy_dir)
    size = model_image_size(SCREEN_W, SCREEN_H, *budget)
    phase = g.phases[i]
    fixed = real_screens(p, size, [phase], held=False)[0].get(phase.miniwob_seeds)
    want = checkpoint_fingerprint(ground_config(phase), p.policy.system_prompt, fixed)
    if states[i]["fingerprint"] != want:
        raise ValueError(
            f"ground snapshot: {path} was made by another phase {i} than these params' (fingerprint "
            f"{states[i]['fingerprint']}, theirs {want}): give the run's preset and overrides"
        )
    policy = load_policy(start, min_pixels=budget[0], max_pixels=budget[1])
    for ph in g.phases[: i + 1]:  # the depths the run had at phase i
        policy = grown(policy, ph)
    policy.model.load_state_dict(states[i]["model"])
    entry = {
        "checkpoint": str(path),
        "phase": i,
        "step": states[i]["step"],
        "phase_steps": phase.steps,
        "seconds": round(states[i]["seconds"], 1),
        "fingerprint": want,
    }
    report = _report_head(g, start, source_commit(Path.cwd())) | {
        "snapshot": entry,
        "phases": [
            {
                "phase": j,
                "steps": s["step"],
                "seconds": round(s["seconds"], 1),
                "curve": s["history"]["evals"],
            }
            for j, s in states.items()
        ],
    }
    staged = dest.parent / f".{dest.name}.snapshot"  # whole or nothing at dest
    shutil.rmtree(staged, ignore_errors=True)
    policy.save(staged)
    atomic_write_json(staged / GROUND_REPORT, report, indent=1, sort_keys=True)
    if dest.exists():
        dest.rmdir()
    staged.rename(dest)
    return entry


STAGE = Stage(
    "ground",
    run=run,
    snapshot=snapshot,
    params=(
        "ground",
        "policy.system_prompt",
        "policy.max_new_tokens",
        "policy.click_readout",
        "env.kind",
        "env.in_domain_suite",
        "env.out_of_domain_suite",
        "env.episode_time_limit_s",
    ),
    inputs={"policy_dir": "models/init"},
    outputs={"out_dir": "models/grounded"},
    artifacts={"models/grounded": "policy"},
    progress=True,  # decision "Curves while it trains"
    # ground.checkpoint lives here; a DVC dep cannot depend on a param, so the whole folder is one.
    data=(*TASK_DATA, "assets/checkpoints"),
)
