"""A pipeline stage as one typed object: what it runs, reads and writes, and how the front doors track it.

Each stage module under `arpo_core/pipeline/` ends with its `STAGE = Stage(...)` (the offline module with
`STAGES`, one per method); the table (`table.py`) imports those objects directly, so "go to definition"
leads from the table to the code and no front door looks anything up by name.

Decisions:
- **Stage fields.** Everything a front door needs is a field: the `run(p, **consts, **inputs, **outputs)`
  function, the params keys it reads, its inputs and outputs (the keyword arguments of `run`, as paths), extra
  data it reads, whether it runs envs (then Prefect retries it), whether it reports per-iteration metrics, and
  the tracking hooks (`headline`, `tracked_params`, `epoch_history`, `model_inputs`, `list_artifacts`)
  and the `snapshot` hook where a stage has them. `dvc.yaml` is generated from the table (`arpo
  dvc-yaml`; tests/test_dvc.py checks the file equals the generation); no stage name appears in an `if`
  anywhere.
- **Derived code deps.** Code deps are derived, not declared: the import closure of the module defining `run`
  inside the project (module-level and function-level imports, found with `ast`), so a change to any module a
  stage imports (e.g. `rewards.py` under rollout) re-runs it, under DVC and under `arpo run` alike.
  Directories whose every module is in the closure are listed as the directory.
- **Read params keys.** Params keys are the ones the stage's code reads, including cross-section reads (the
  demos use `baseline.max_steps`; every rollout uses `train.loss.format_penalty`); tests/test_stage.py
  checks every `p.<section>.<key>` read of a stage module against them. Operational env settings
  (number of envs, backend, timeouts, torch threads) are left out: they change speed, not results, so
  changing them re-runs nothing.
- **Exclusive outputs.** Outputs are directories or files that only that stage writes (DVC forbids overlapping
  outputs): the offline stages write their policy to `models/<method>` and their evaluation to
  `data/eval_<method>`; `evaluate` writes `data/eval`; `compare` reads all of them.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "DURING_TRAINING",
    "EVALUATION",
    "OPERATIONAL",
    "ROLLOUT",
    "ROOT",
    "SUITES",
    "TASK_DATA",
    "Stage",
    "code_deps",
    "import_closure",
]

ROOT = Path(__file__).resolve().parents[2]
"""The project root (arpo_core's parent)."""
PACKAGE = "arpo_core"

ROLLOUT = ("policy", "train.loss.format_penalty", "project.seed")
SUITES = (
    "env.kind",
    "env.in_domain_suite",
    "env.out_of_domain_suite",
    "env.episode_time_limit_s",
    "env.osworld.screen_width",
    "env.osworld.screen_height",
)
"""What the envs the episodes run in depend on (MiniWoB's clock, the desktop's screen)."""
TASK_DATA = ("data/suites", "data/osworld")
"""Suite files, and the OSWorld task files OSWorld suites name."""
EVALUATION = ("evaluate", *ROLLOUT, *SUITES)
DURING_TRAINING = (
    "evaluate.during_training",
    "evaluate.during_training_episodes",
    "evaluate.temperature",
    "evaluate.top_p",
    "evaluate.max_steps",
    "evaluate.seed",
    "evaluate.samples_per_instance",
    "evaluate.osworld_hard",
)
"""The evaluate keys the train stage reads for its evaluations during training (not episodes_per_task:
changing the evaluate stage's size must not re-run training)."""
OPERATIONAL = (
    "project.torch_threads",
    "env.n_envs",
    "env.backend",
    "env.reset_timeout_s",
    "env.step_timeout_s",
    "env.eval_timeout_s",
    "env.reset_retries",
    "env.ray_resources",
    "env.rollout",
    "env.osworld.provider",
    "env.osworld.base_urls",
    "env.osworld.token",
    "env.osworld.claim_dir",
    "env.osworld.health_timeout_s",
    "env.osworld.download_cache_dir",
    "env.osworld.desktop_env_python",
    "env.osworld.desktop_env_args",
    "env.osworld.desktop_env_timeout_s",
    "env.osworld.command_timeout_s",
    "train.distributed",
    "train.gradient_checkpointing",
    "ground.checkpoint_every_s",
    "ground.screen_cache",
)
"""Keys stages read that change speed or where episodes run, not their results (decision "Read params keys"):
in no stage's params, so changing them re-runs nothing."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the same name as its DVC stage, Prefect flow, params section and MLflow run."""

    name: str
    run: Callable[..., dict[str, Any]]
    """`run(p, **consts, **inputs, **outputs)` does the work and returns its metrics."""
    params: tuple[str, ...]
    """Dotted params keys it reads (a section name means the whole section)."""
    inputs: Mapping[str, str | tuple[str, ...]]
    """Keyword argument -> input path (or paths): upstream outputs and data."""
    outputs: Mapping[str, str]
    """Keyword argument -> output path (DVC-tracked, written by this stage only)."""
    consts: Mapping[str, Any] = field(default_factory=dict)
    """Other keyword arguments (e.g. the offline method)."""
    data: tuple[str, ...] = ()
    """Further input paths the code reads without an argument (suite files, versioned checkpoints)."""
    envs: bool = False
    """Runs environments (browsers, desktops): Prefect retries it with back-off."""
    iterations: bool = False
    """Reports per-iteration metrics: `run` takes an `on_metrics(step, metrics)` hook (and DVC tracks the
    stage's per-epoch table)."""
    progress: bool = False
    """Reports curves while it runs (ground's held-out measures): `run` takes the same `on_metrics(step,
    metrics)` hook, logged under `iter/` like iterations; no per-epoch table."""
    snapshot: Callable[..., dict[str, Any]] | None = None
    """`snapshot(p, dest=..., **inputs, **outputs)` with the outputs at their staging paths: what a running or
    interrupted attempt has so far, written as a usable output at `dest` without touching the attempt
    (`arpo snapshot`; ground: the latest phase checkpoint as a policy, ground.py decision "Snapshots")."""
    viewer: bool = True
    """Trajectory outputs get viewer pages (the oracle demos do not: nothing of the policy's to see)."""
    artifacts: Mapping[str, str] = field(default_factory=dict)
    """Output path -> MLflow artifact directory (default: the output's own path)."""
    list_artifacts: Callable[..., list[tuple[Path, str]]] | None = None
    """`list_artifacts(**outputs)` -> (path, artifact dir) pairs, replacing `artifacts` (train: the last
    checkpoint, not every epoch's)."""
    headline: Callable[[Any, Mapping[str, float]], dict[str, float]] | None = None
    """`headline(p, metrics)` -> the metric a user compares first under a `_` key (flows/runner.py)."""
    tracked_params: Callable[[Any], dict[str, str]] | None = None
    """`tracked_params(p)` -> extra params its MLflow run logs (the trained policy's `method`)."""
    epoch_history: Callable[..., list[dict[str, Any]]] | None = None
    """`epoch_history(**outputs)` -> one metrics row per completed epoch (train)."""
    model_inputs: Mapping[str, str] = field(default_factory=dict)
    """Metric role -> the input argument holding that policy: `eval/<role>/...` metrics are linked to
    the MLflow model of the stage that wrote it (evaluate: base, trained)."""

    @property
    def module(self) -> str:
        """The dotted module defining `run` (whose import closure is the stage's code)."""
        return self.run.__module__

    @property
    def metrics(self) -> str:
        """The stage's metrics file (flat slash-namespaced floats, the same keys as in MLflow)."""
        return f"metrics/{self.name}.json"

    @property
    def outs(self) -> tuple[str, ...]:
        return tuple(self.outputs.values())

    @property
    def input_paths(self) -> tuple[str, ...]:
        paths: list[str] = []
        for v in self.inputs.values():
            paths += [v] if isinstance(v, str) else list(v)
        return tuple(paths)

    @property
    def deps(self) -> tuple[str, ...]:
        """Code (decision "Derived code deps"), then data, then inputs: what DVC hashes and the up-to-date
        check hashes."""
        return (*code_deps(self.module), *self.data, *self.input_paths)

    def kwargs(self, root: Path = Path(".")) -> dict[str, Any]:
        """The keyword arguments of `run`, paths under `root`."""

        def at(v: str | tuple[str, ...]) -> Any:
            return root / v if isinstance(v, str) else [root / x for x in v]

        return {
            **self.consts,
            **{k: at(v) for k, v in self.inputs.items()},
            **{k: at(v) for k, v in self.outputs.items()},
        }


# ------------------------------------------------------------------------------------------------
# Code deps (decision "Derived code deps")


def _module_file(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imported_modules(path: Path) -> Iterable[str]:
    """Every project module `path` imports, at any depth of the file (function-level imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`


@cache
def import_closure(module: str, root: Path = ROOT) -> tuple[str, ...]:
    """Files (relative to `root`, sorted) of `module` and every project module it imports, transitively.
    Packages' `__init__.py` files on the way count too (importing `a.b.c` runs `a/__init__` and
    `a/b/__init__`)."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name.split(".")[0] != PACKAGE:
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            f = _module_file(".".join(parts[:i]), root)
            if f is not None and f not in seen:
                seen.add(f)
                todo += list(_imported_modules(f))
    return tuple(sorted(f.relative_to(root).as_posix() for f in seen))


@cache
def code_deps(module: str, root: Path = ROOT) -> tuple[str, ...]:
    """`import_closure` of `module` (dotted), each directory whose every module is in it written as the
    directory (decision "Derived code deps")."""
    files = set(import_closure(module, root))
    dirs = sorted({str(Path(f).parent) for f in files}, key=lambda d: (d.count("/"), d))
    whole: list[str] = []
    for d in dirs:
        if any(d == w or d.startswith(w + "/") for w in whole):
            continue
        every = {
            p.relative_to(root).as_posix() for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts
        }
        if d != PACKAGE and every <= files:
            whole.append(d)
    covered = [f for f in files if not any(f.startswith(w + "/") for w in whole)]
    return tuple(sorted(whole + covered))
