"""What each pipeline stage reads and writes, and when its outputs are up to date.

Decisions:
1. One table, `STAGES`, declares every stage's code + input deps, the dotted params keys it reads, its
   outputs and its metrics file, in pipeline order. `dvc.yaml` declares the same things for DVC; a test
   (tests/test_dvc.py) checks that the two agree key for key, so `dvc repro` and the Prefect pipeline
   re-run a stage for the same reasons.
2. Params keys are the ones the stage's code actually reads, including cross-section reads (the demos
   use `baseline.max_steps`; rollouts use `train.top_p` and `train.loss.format_penalty`). Operational
   env settings (number of envs, backend, timeouts) are left out: they change speed, not results, so
   changing them does not re-run anything.
3. Up to date = a stamp written after the stage succeeded matches now. The stamp stores a key (hash of
   the stage's params values + the content of its deps, code included: that is the code version) and a
   fingerprint of the outputs as written. A changed param, input or code file changes the key; a
   deleted or replaced output (e.g. `dvc checkout` of another experiment) changes the fingerprint.
   Either one re-runs the stage. Stamps live in `.arpo/stamps/<stage>.json` (git- and DVC-ignored) so
   they never alter a DVC-tracked output.
4. Hashes are sha256 over (relative path, bytes) of the files in sorted order; `__pycache__`, dotfiles
   and temp names are skipped so that running Python does not make code look changed (the same
   patterns are in .dvcignore for DVC's own hashes).
5. `ground` (grounding pretraining, docs/design.md) sits between `init_policy` and `sft`, which trains from
   its output `models/grounded`. Its start may be `ground.checkpoint`, a directory named by a param;
   DVC cannot make a dep depend on a param, so the whole `assets/checkpoints` directory is a dep (a
   changed versioned checkpoint re-runs `ground`; a checkpoint outside it is not hashed). It reads the in-domain suite for its real MiniWoB
   screens (`env.in_domain_suite`, the suite files, the env code) and the prompt (`policy.system_prompt`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_core.config import Params, to_dict
from arpo_core.fileio import atomic_write_json

__all__ = [
    "STAGES",
    "STAGE_NAMES",
    "StageSpec",
    "fingerprint",
    "is_up_to_date",
    "read_stamp",
    "stage_key",
    "stage_params",
    "write_stamp",
]

ROLLOUT_PARAMS = ("policy", "train.top_p", "train.loss.format_penalty", "project.seed")
SUITE_PARAMS = ("env.in_domain_suite", "env.out_of_domain_suite", "env.episode_time_limit_s")
ENV_CODE = ("arpo_core/envs", "arpo_core/rollout.py", "arpo_core/trajectory.py", "arpo_core/actions.py")
POLICY_CODE = ("arpo_core/policy",)


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: the same name as its DVC stage, Prefect flow, params section and MLflow run."""

    name: str
    deps: tuple[str, ...]
    """Code and input paths (files or directories, relative to the project root)."""
    params: tuple[str, ...]
    """Dotted params keys it reads (a section name means the whole section)."""
    outs: tuple[str, ...]
    """Output paths (DVC-tracked)."""

    @property
    def metrics(self) -> str:
        """The stage's metrics file (flat slash-namespaced floats, the same keys as in MLflow)."""
        return f"metrics/{self.name}.json"


STAGES: tuple[StageSpec, ...] = (
    StageSpec(
        "init_policy",
        deps=("arpo_core/stages.py", *POLICY_CODE),
        params=("init_policy",),
        outs=("models/init",),
    ),
    StageSpec(
        "ground",
        deps=(
            "arpo_core/stages.py",
            "arpo_core/grounding.py",
            *POLICY_CODE,
            "arpo_core/envs",
            "arpo_core/actions.py",
            "arpo_core/trajectory.py",
            "data/suites",
            "assets/checkpoints",
            "models/init",
        ),
        params=("ground", "policy.system_prompt", "env.in_domain_suite"),
        outs=("models/grounded",),
    ),
    StageSpec(
        "demos",
        deps=("arpo_core/stages.py", "arpo_core/demos.py", *ENV_CODE, "data/suites"),
        params=("demos", "baseline.max_steps", *SUITE_PARAMS),
        outs=("data/demos",),
    ),
    StageSpec(
        "sft",
        deps=("arpo_core/stages.py", "arpo_core/offline.py", *POLICY_CODE, "models/grounded", "data/demos"),
        params=("sft", "policy.system_prompt", "policy.history_images"),
        outs=("models/base",),
    ),
    StageSpec(
        "baseline",
        deps=("arpo_core/stages.py", *ENV_CODE, *POLICY_CODE, "data/suites", "models/base"),
        params=("baseline", *ROLLOUT_PARAMS, *SUITE_PARAMS),
        outs=("data/baseline",),
    ),
    StageSpec(
        "select",
        deps=("arpo_core/stages.py", "arpo_core/selection.py", "data/suites", "data/baseline"),
        params=("select", "env.in_domain_suite"),
        outs=("data/selected_tasks.json",),
    ),
    StageSpec(
        "train",
        deps=(
            "arpo_core/stages.py",
            "arpo_core/trainer.py",
            "arpo_core/update.py",
            "arpo_core/losses.py",
            "arpo_core/advantages.py",
            "arpo_core/replay.py",
            "arpo_core/engines.py",
            *ENV_CODE,
            *POLICY_CODE,
            "data/suites",
            "models/base",
            "data/selected_tasks.json",
        ),
        params=("train", "policy", "project.seed", *SUITE_PARAMS),
        outs=("models/arpo",),
    ),
    StageSpec(
        "evaluate",
        deps=(
            "arpo_core/stages.py",
            "arpo_core/evaluate.py",
            *ENV_CODE,
            *POLICY_CODE,
            "data/suites",
            "models/base",
            "models/arpo",
        ),
        params=("evaluate", *ROLLOUT_PARAMS, *SUITE_PARAMS),
        outs=("data/eval",),
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
SPECS: dict[str, StageSpec] = {s.name: s for s in STAGES}


# ------------------------------------------------------------------------------------------------
# Params of a stage


def _lookup(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def stage_params(p: Params, spec: StageSpec) -> dict[str, Any]:
    """{dotted key: value} of the params a stage reads, sections flattened (what MLflow logs and what
    the stage key hashes). `stage_params(p, SPECS['select'])` ->
    `{'select.min_successes': 1, ..., 'env.in_domain_suite': 'data/suites/...'}`."""
    tree = to_dict(p)
    out: dict[str, Any] = {}
    for key in spec.params:
        value = _lookup(tree, key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, key))
        else:
            out[key] = value
    return out


def _flatten(d: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}"
        out.update(_flatten(v, key) if isinstance(v, Mapping) and v else {key: v})
    return out


# ------------------------------------------------------------------------------------------------
# Hashes and stamps (decisions 3-4)

SKIP_DIRS = {"__pycache__"}


def _files(path: Path) -> Iterable[Path]:
    if path.is_file():
        yield path
        return
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith(".") and not f.endswith((".pyc", ".tmp")):
                yield Path(dirpath) / f


def fingerprint(paths: Iterable[str], root: Path) -> str:
    """sha256 over (relative path, content) of every file under `paths`; a missing path hashes as
    missing, so creating it changes the fingerprint."""
    h = hashlib.sha256()
    for rel in paths:
        path = root / rel
        if not path.exists():
            h.update(f"missing:{rel}\n".encode())
            continue
        for f in _files(path):
            h.update(f"{f.relative_to(root).as_posix()}\n".encode())
            with f.open("rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def stage_key(p: Params, spec: StageSpec, root: Path) -> str:
    """Hash of what determines a stage's outputs: its params values and the content of its deps."""
    params = json.dumps(stage_params(p, spec), sort_keys=True, default=str)
    return hashlib.sha256(f"{spec.name}\n{params}\n{fingerprint(spec.deps, root)}".encode()).hexdigest()


def stamp_path(root: Path, name: str) -> Path:
    return root / ".arpo" / "stamps" / f"{name}.json"


def read_stamp(root: Path, name: str) -> dict[str, Any] | None:
    path = stamp_path(root, name)
    return json.loads(path.read_text()) if path.exists() else None


def write_stamp(root: Path, spec: StageSpec, key: str, extra: Mapping[str, Any] | None = None) -> None:
    """Record that `spec`'s outputs, as they are now, were produced from `key` (atomic replace)."""
    path = stamp_path(root, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"key": key, "outs": fingerprint(spec.outs, root), "time": time.time(), **(extra or {})}
    atomic_write_json(path, stamp, indent=1, sort_keys=True)


def is_up_to_date(p: Params, spec: StageSpec, root: Path) -> bool:
    """True when the stage ran with this key and its outputs are unchanged since (decision 3)."""
    stamp = read_stamp(root, spec.name)
    if stamp is None or not all((root / o).exists() for o in spec.outs):
        return False
    return stamp.get("key") == stage_key(p, spec, root) and stamp.get("outs") == fingerprint(spec.outs, root)
