"""When a stage's outputs are up to date, and the `dvc.yaml` that says the same to DVC.

Decisions:
- **Stage table.** The stage table (`arpo_core/pipeline/table.py`) declares every stage's deps (code derived
  from its imports, data, inputs), params keys, outputs and metrics file. `dvc_yaml()` renders `dvc.yaml` from
  it (`arpo dvc-yaml` writes the file; tests/test_dvc.py checks the committed file equals it), so
  `dvc repro` and `arpo run` re-run a stage for the same reasons.
- **Stamps.** Up to date = a stamp written after the stage succeeded matches now. The stamp stores a key (hash
  of the stage's params values + the content of its deps, code included: that is the code version) and a
  fingerprint of the outputs as written. A changed param, input or code file changes the key; a
  deleted or replaced output (e.g. `dvc checkout` of another experiment) changes the fingerprint.
  Either one re-runs the stage. Stamps live in `.arpo/stamps/<stage>.json` (git- and DVC-ignored) so
  they never alter a DVC-tracked output. A stamp keeps the last STAMP_HISTORY (key, outputs) pairs it
  recorded, so outputs brought back as they were (`dvc checkout` / `dvc exp apply` of an earlier
  experiment, with its params) are up to date again instead of re-running.
- **One staleness authority.** The stamp is the one staleness authority (docs/design.md,
  "When a stage re-runs"): `arpo run` skips a stage whose stamp matches, and so does `arpo stage` (every DVC
  stage's cmd), so `dvc repro` after an `arpo run` or a deployment run only records what is there, and both
  front doors re-run a stage for exactly the same reasons. DVC still decides which commands to call (dvc.lock)
  and caches and versions the outputs; `--force` on either command re-runs regardless.
- **File hashes.** Hashes are sha256 over (relative path, bytes) of the files in sorted order; `__pycache__`,
  dotfiles and temp names are skipped so that running Python does not make code look changed (the same
  patterns are in .dvcignore for DVC's own hashes).
- **Effective params.** A stage's *effective* params are its own plus those of every stage upstream of it (the
  stages whose outputs it reads, transitively): the stage key needs only its own (upstream outputs are hashed
  as deps), but a tracked run must show everything its result depends on.
- **Short metrics files.** Metrics files are short: `metrics/<stage>.json` (what `dvc metrics show` reads)
  holds the summary keys; per-task, per-domain and per-level breakdowns go to `metrics/details/<stage>.json`,
  a plain output, not a DVC metric. MLflow gets both.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from arpo_core.config import Params, flatten, to_dict
from arpo_core.infra.fileio import atomic_write_json
from arpo_core.pipeline.stage import OPERATIONAL
from arpo_core.pipeline.table import BY_NAME, STAGE_NAMES, STAGES, Stage
from arpo_core.pipeline.table import upstream as table_upstream

__all__ = [
    "SPECS",
    "STAGE_NAMES",
    "STAMP_HISTORY",
    "details_path",
    "dvc_outs",
    "dvc_yaml",
    "effective_params",
    "file_hashes",
    "fingerprint",
    "is_detail",
    "is_up_to_date",
    "matching_stamp",
    "read_stamp",
    "split_metrics",
    "stage_key",
    "stage_params",
    "upstream",
    "write_stamp",
]

SPECS: dict[str, Stage] = BY_NAME
"""The stage table's rows by name (arpo_core/pipeline/table.py `BY_NAME`, the same dict)."""


# ------------------------------------------------------------------------------------------------
# Params of a stage


def _lookup(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def stage_params(p: Params, spec: Stage) -> dict[str, Any]:
    """{dotted key: value} of the params a stage reads, sections flattened (what MLflow logs and what
    the stage key hashes). `stage_params(p, SPECS['select'])` ->
    `{'select.min_successes': 1, ..., 'env.in_domain_suite': 'data/suites/...'}`."""
    tree = to_dict(p)
    out: dict[str, Any] = {}
    for key in spec.params:
        value = _lookup(tree, key)
        if isinstance(value, Mapping):
            out.update(flatten(value, key))
        else:
            out[key] = value
    # operational keys inside a listed section (train.distributed) change speed, not results
    return {k: v for k, v in out.items() if not any(k == o or k.startswith(o + ".") for o in OPERATIONAL)}


def upstream(spec: Stage) -> tuple[Stage, ...]:
    """Every stage whose outputs `spec` reads, directly or through other stages, in table order
    (decision "Effective params"; the table's one graph walk). `upstream(SPECS['evaluate'])` -> init_policy,
    ground, demos, sft, baseline, select, train."""
    return tuple(SPECS[n] for n in table_upstream([spec.name]) if n != spec.name)


def effective_params(p: Params, spec: Stage) -> dict[str, Any]:
    """Decision "Effective params": the params that determine a stage's outputs: its own (`stage_params`),
    every upstream stage's, and its constants (the offline stages' `method`). What its MLflow run logs, so two
    runs of a stage differ in params whenever their results can differ (the evaluate runs of ARPO and GRPO
    differ in `train.replay.enabled`)."""
    out: dict[str, Any] = {}
    for s in (*upstream(spec), spec):
        out.update(stage_params(p, s))
    out.update({k: v for k, v in spec.consts.items() if isinstance(v, str | int | float | bool)})
    return out


# ------------------------------------------------------------------------------------------------
# Hashes and stamps (decisions "Stamps" and "File hashes")

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


def _dep_files(paths: Iterable[str], root: Path) -> Iterable[tuple[str, Path | None]]:
    """(relative path, file) of every file under `paths` in hashing order; (path, None) for a missing one."""
    for rel in paths:
        path = root / rel
        if not path.exists():
            yield rel, None
            continue
        for f in _files(path):
            yield f.relative_to(root).as_posix(), f


def fingerprint(paths: Iterable[str], root: Path) -> str:
    """sha256 over (relative path, content) of every file under `paths`; a missing path hashes as
    missing, so creating it changes the fingerprint."""
    h = hashlib.sha256()
    for rel, f in _dep_files(paths, root):
        if f is None:
            h.update(f"missing:{rel}\n".encode())
            continue
        h.update(f"{rel}\n".encode())
        with f.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def file_hashes(paths: Iterable[str], root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file `fingerprint` reads under `paths` (a missing path: "missing"),
    to say which of them changed between two keys."""
    return {
        rel: "missing" if f is None else hashlib.sha256(f.read_bytes()).hexdigest()
        for rel, f in _dep_files(paths, root)
    }


def stage_key(p: Params, spec: Stage, root: Path) -> str:
    """Hash of what determines a stage's outputs: its params values and the content of its deps."""
    params = json.dumps(stage_params(p, spec), sort_keys=True, default=str)
    return hashlib.sha256(f"{spec.name}\n{params}\n{fingerprint(spec.deps, root)}".encode()).hexdigest()


def stamp_path(root: Path, name: str) -> Path:
    return root / ".arpo" / "stamps" / f"{name}.json"


def read_stamp(root: Path, name: str) -> dict[str, Any] | None:
    path = stamp_path(root, name)
    return json.loads(path.read_text()) if path.exists() else None


STAMP_HISTORY = 16
"""How many earlier (key, outputs) pairs a stamp remembers besides its newest (decision "Stamps")."""


def _entries(stamp: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A stamp's records, newest first, each without the history list."""
    if not stamp:
        return []
    newest = {k: v for k, v in stamp.items() if k != "history"}
    return [newest, *(dict(e) for e in stamp.get("history") or ())]


def write_stamp(root: Path, spec: Stage, key: str, extra: Mapping[str, Any] | None = None) -> None:
    """Record that `spec`'s outputs, as they are now, were produced from `key` (atomic replace); the
    earlier records stay in `history` (decision "Stamps"), an identical pair replaced by the new one."""
    path = stamp_path(root, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "outs": fingerprint(spec.outs, root), "time": time.time(), **(extra or {})}
    same = (entry["key"], entry["outs"])
    older = [e for e in _entries(read_stamp(root, spec.name)) if (e.get("key"), e.get("outs")) != same]
    atomic_write_json(path, {**entry, "history": older[:STAMP_HISTORY]}, indent=1, sort_keys=True)


def dvc_outs(spec: Stage) -> tuple[str, ...]:
    """Every file a stage writes that DVC tracks: its outputs, its metrics summary and breakdown, the
    per-epoch table of a stage with iterations."""
    return (*spec.outs, spec.metrics, details_path(spec), *([EPOCH_TABLE] if spec.iterations else ()))


def matching_stamp(p: Params, spec: Stage, root: Path) -> dict[str, Any] | None:
    """The stamp record that produced `spec`'s outputs as they are now with these params, inputs and
    code, or None (the stage must run): every file it writes exists, and its key and the outputs'
    fingerprint equal one recorded pair (decision "Stamps")."""
    entries = _entries(read_stamp(root, spec.name))
    if not entries or not all((root / o).exists() for o in dvc_outs(spec)):
        return None
    key, outs = stage_key(p, spec, root), fingerprint(spec.outs, root)
    return next((e for e in entries if e.get("key") == key and e.get("outs") == outs), None)


def is_up_to_date(p: Params, spec: Stage, root: Path) -> bool:
    """True when the stage ran with this key and its outputs are as that run left them (decision "Stamps");
    the one test both `arpo run` and `arpo stage` (DVC) apply (decision "One staleness authority")."""
    return matching_stamp(p, spec, root) is not None


# ------------------------------------------------------------------------------------------------
# dvc.yaml (decision "Stage table")

DVC_HEADER = """\
# GENERATED from the stage table (arpo_core/pipeline/table.py) by `arpo dvc-yaml`; do not edit by hand
# (tests/test_dvc.py fails when this file and the table differ). Each stage runs `arpo stage NAME`, the
# stage's Prefect flow body without a Prefect server, tracked in MLflow.
#   dvc repro                                      # runs what changed; again: nothing to do
#   dvc exp run -S train.replay.enabled=false      # an ablation (GRPO), compared with `dvc exp show`
# Stage commands need `arpo` on PATH: `source .venv/bin/activate` first (docs/orchestration.md).
"""
EPOCH_TABLE = "plots/train_epochs.csv"
"""The train stage's per-epoch rows (flows/runner.py PLOT_COLUMNS): a plain output, for tools."""
EPOCH_PLOT = "plots/train_epochs.png"
"""The same rows drawn (EPOCH_PANELS): what `dvc plots show` shows for training."""
EPOCH_PANELS = {
    "success rate": ("rollout/success_rate", "rollout/format_error_rate"),
    "replay fills": ("replay/groups_filled", "replay/fill_rate"),
    "policy loss": ("loss/policy",),
}
DVC_PLOTS = ["reports/comparison/comparison.png"]
"""Image plots only (the train stage declares its own, EPOCH_PLOT): DVC renders them as <img> tags,
so the page `dvc plots show` writes loads no script (DVC's data-series plots load Vega from a CDN and
stay blank offline)."""


DETAIL_PARTS = frozenset({"task", "domain", "all", "time", "faults", "first", "last"})
"""Path components that mark a breakdown (per task, per domain, both splits pooled, timings, fault
counts, first/last optimiser steps) rather than a headline number (decision "Short metrics files")."""
HEADLINE_ENDS = (
    "success_rate",
    "hit_rate",
    "delta_vs_base",
    "image_blind/in_domain",
    "loss_last",
    "loss/policy",
    "groups_filled",
    "kept",
    "parameters",
)
"""Summary keys end so: success rates, grounding hit rates, paired deltas, final losses, replay fills,
the selection and model sizes; plus `<stage>/episodes`. Not in the summary: image-blind variants
(`blind_hit_rate`), the compare stage's success rates (the evaluations' own summary has them) and wall
times (all in the details file and MLflow)."""


def is_detail(key: str) -> bool:
    """Decision "Short metrics files": a breakdown key
    ('eval/trained/greedy/task/miniwob/click-button/success_rate', 'task/miniwob/x/episodes', 'iter/...',
    'rollout/faults/timeouts') rather than a headline one ('eval/trained/greedy/in_domain/success_rate',
    'rollout/success_rate')."""
    parts = key.split("/")
    if parts[0] in ("iter", "task", "time") or DETAIL_PARTS & set(parts[:-1]):
        return True
    if parts[-1].startswith("blind_") or (parts[0] == "compare" and parts[-1] == "success_rate"):
        return True
    if len(parts) == 2 and parts[1] == "episodes":
        return False
    return not key.endswith(HEADLINE_ENDS)


def split_metrics(metrics: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(summary, details) of a stage's metrics (decision "Short metrics files")."""
    summary = {k: v for k, v in metrics.items() if not is_detail(k)}
    details = {k: v for k, v in metrics.items() if is_detail(k)}
    return summary, details


def details_path(spec: Stage) -> str:
    """Where a stage's breakdown metrics go (decision "Short metrics files"): a DVC output, not a DVC
    metric."""
    return f"metrics/details/{spec.name}.json"


def dvc_yaml() -> str:
    """The text of dvc.yaml: one DVC stage per table row, in order, plus the image plots."""
    import yaml

    stages: dict[str, Any] = {}
    for s in STAGES:
        entry: dict[str, Any] = {
            "cmd": f"arpo stage {s.name}",
            "deps": list(s.deps),
            "params": list(s.params),
            # persist: DVC deletes a stage's outputs before its command runs unless told not to; the
            # runner replaces them itself, and only once the stage succeeded (flows/runner.py,
            # decision "Staged outputs")
            "outs": [{o: {"persist": True}} for o in dvc_outs(s) if o != s.metrics],
            "metrics": [{s.metrics: {"persist": True}}],
        }
        if s.iterations:
            entry["plots"] = [{EPOCH_PLOT: {"persist": True}}]
        stages[s.name] = entry
    body = yaml.safe_dump({"stages": stages, "plots": DVC_PLOTS}, sort_keys=False, width=120)
    return DVC_HEADER + body
