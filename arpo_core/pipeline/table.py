"""The stage table: every pipeline stage declared once.

Decisions:
1. One `Stage` row per stage, in pipeline order, declares everything the front doors need: the module
   whose `run(p, **args)` does the work, the params keys it reads, its inputs and outputs (the keyword
   arguments of `run`, as paths), extra data it reads, whether it runs envs (then Prefect retries it),
   and whether it reports per-iteration metrics. `dvc.yaml` is generated from this table
   (`arpo dvc-yaml`; tests/test_dvc.py checks the file equals the generation), the Prefect flows and
   tasks are built from it, and the runner reads it; no stage name appears in an `if` anywhere.
2. Code deps are derived, not declared: the import closure of the stage's module inside the project
   (module-level and function-level imports, found with `ast`), so a change to any module a stage
   imports (e.g. `rewards.py` under rollout) re-runs it, under DVC and under `arpo run` alike.
   Directories whose every module is in the closure are listed as the directory.
3. Params keys are the ones the stage's code reads, including cross-section reads (the demos use
   `baseline.max_steps`; rollouts use `train.top_p` and `train.loss.format_penalty`). Operational env
   settings (number of envs, backend, timeouts, torch threads) are left out: they change speed, not
   results, so changing them re-runs nothing.
4. Outputs are directories or files that only that stage writes (DVC forbids overlapping outputs):
   the offline stages write their policy to `models/<method>` and their evaluation to
   `data/eval_<method>`; `evaluate` writes `data/eval`; `compare` reads all of them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "STAGES", "STAGE_NAMES", "Stage", "code_deps", "import_closure", "stage", "upstream"]

ROOT = Path(__file__).resolve().parents[2]
"""The project root (arpo_core's parent)."""
PACKAGE = "arpo_core"

ROLLOUT = ("policy", "train.top_p", "train.loss.format_penalty", "project.seed")
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
    "evaluate.max_steps",
    "evaluate.seed",
)
"""The evaluate keys the train stage reads for its evaluations during training (not episodes_per_task:
changing the evaluate stage's size must not re-run training)."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the same name as its DVC stage, Prefect flow, params section and MLflow run."""

    name: str
    module: str
    """Module under arpo_core/pipeline whose `run(p, **consts, **inputs, **outputs)` does the work."""
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
    """Reports per-iteration metrics: `run` takes an `on_metrics(step, metrics)` hook."""
    viewer: bool = True
    """Trajectory outputs get viewer pages (the oracle demos do not: nothing of the policy's to see)."""
    artifacts: Mapping[str, str] = field(default_factory=dict)
    """Output path -> MLflow artifact directory (default: the output's own path); a stage module's
    `artifacts(...)` function, where it has one, replaces this."""

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
        """Code (decision 2), then data, then inputs: what DVC hashes and the up-to-date check hashes."""
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


OFFLINE = ("rft", "dpo", "kto")

STAGES: tuple[Stage, ...] = (
    Stage(
        "init_policy",
        module="init_policy",
        params=("init_policy",),
        inputs={},
        outputs={"out_dir": "models/init"},
        artifacts={"models/init": "policy"},
    ),
    Stage(
        "ground",
        module="ground",
        params=("ground", "policy.system_prompt", "env.kind", "env.in_domain_suite"),
        inputs={"policy_dir": "models/init"},
        outputs={"out_dir": "models/grounded"},
        artifacts={"models/grounded": "policy"},
        # ground.checkpoint lives here; a DVC dep cannot depend on a param, so the whole folder is one.
        data=(*TASK_DATA, "assets/checkpoints"),
    ),
    Stage(
        "demos",
        module="demos",
        params=("demos", "baseline.max_steps", *SUITES),
        inputs={},
        outputs={"out_dir": "data/demos"},
        artifacts={"data/demos": "trajectories"},
        data=TASK_DATA,
        envs=True,
        viewer=False,
    ),
    Stage(
        "sft",
        module="sft",
        params=("sft", "demos.episodes_per_task", "policy.system_prompt", "policy.history_images"),
        inputs={"policy_dir": "models/grounded", "demos_path": "data/demos"},
        outputs={"out_dir": "models/base"},
        artifacts={"models/base": "policy"},
    ),
    Stage(
        "baseline",
        module="baseline",
        params=("baseline", *ROLLOUT, *SUITES),
        inputs={"policy_dir": "models/base"},
        outputs={"out_dir": "data/baseline"},
        artifacts={"data/baseline": "trajectories"},
        data=TASK_DATA,
        envs=True,
    ),
    Stage(
        "select",
        module="select",
        params=("select", "env.kind", "env.in_domain_suite"),
        inputs={"baseline_dir": "data/baseline"},
        outputs={"out_path": "data/selected_tasks.json"},
        artifacts={"data/selected_tasks.json": "selection"},
        data=TASK_DATA,
    ),
    Stage(
        "train",
        module="train",
        params=("train", "policy", "project.seed", *SUITES, *DURING_TRAINING),
        inputs={
            "policy_dir": "models/base",
            "selected_path": "data/selected_tasks.json",
            "baseline_dir": "data/baseline",
        },
        outputs={"out_dir": "models/arpo"},
        data=TASK_DATA,
        envs=True,
        iterations=True,
    ),
    *(
        Stage(
            method,
            module="offline",
            params=(method, *EVALUATION, "train.use_selection"),
            inputs={
                "policy_dir": "models/base",
                "baseline_dir": "data/baseline",
                "selected_path": "data/selected_tasks.json",
            },
            outputs={"out_dir": f"models/{method}", "eval_dir": f"data/eval_{method}"},
            artifacts={f"models/{method}": "policy", f"data/eval_{method}": "trajectories"},
            consts={"method": method},
            data=TASK_DATA,
            envs=True,
        )
        for method in OFFLINE
    ),
    Stage(
        "evaluate",
        module="evaluate",
        params=(*EVALUATION, "train.replay.enabled", "train.image_blind", "train.use_selection"),
        inputs={
            "base_dir": "models/base",
            "trained_dir": "models/arpo",
            "selected_path": "data/selected_tasks.json",
        },
        outputs={"out_dir": "data/eval"},
        artifacts={"data/eval": "trajectories"},
        data=TASK_DATA,
        envs=True,
    ),
    Stage(
        "compare",
        module="compare",
        params=("compare", "evaluate", "train.use_selection", *SUITES),
        inputs={
            "eval_dirs": ("data/eval", *(f"data/eval_{m}" for m in OFFLINE)),
            "offline_dirs": tuple(f"models/{m}" for m in OFFLINE),
            "train_dir": "models/arpo",
            "selected_path": "data/selected_tasks.json",
        },
        outputs={"out_dir": "reports/comparison"},
        artifacts={"reports/comparison": "report"},
        data=TASK_DATA,
        envs=True,
        viewer=False,
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
_BY_NAME = {s.name: s for s in STAGES}


def stage(name: str) -> Stage:
    """The row of stage `name`; an unknown name is an error listing the stages."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}") from None


def upstream(targets: Iterable[str]) -> tuple[str, ...]:
    """The stages `targets` need, themselves included, in pipeline order: every stage that writes one of
    their inputs, recursively (what `dvc repro TARGET` runs). An unknown name is an error."""
    producer = {out: s.name for s in STAGES for out in s.outs}
    need: set[str] = set()
    todo = [stage(t).name for t in targets]
    while todo:
        name = todo.pop()
        if name in need:
            continue
        need.add(name)
        todo += [producer[path] for path in stage(name).input_paths if path in producer]
    return tuple(n for n in STAGE_NAMES if n in need)


# ------------------------------------------------------------------------------------------------
# Code deps (decision 2)


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
    """`import_closure` of `arpo_core.pipeline.<module>`, each directory whose every module is in it
    written as the directory (decision 2)."""
    files = set(import_closure(f"{PACKAGE}.pipeline.{module}", root))
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
