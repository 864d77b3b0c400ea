"""The stage objects (arpo_core/pipeline/stage.py): the table holds them directly, the front doors look
nothing up by name, and each stage's params keys cover what its code reads (stage.py,
decision "Read params keys")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from arpo_core.pipeline.stage import OPERATIONAL, ROOT, Stage
from arpo_core.pipeline.table import STAGES

OFFLINE_SECTIONS = {"rft", "dpo", "kto"}
"""offline_baselines.py reads `p.<method>` behind `if method == ...` branches a static walk cannot follow: each
offline stage declares its own section whole, and reads of another method's section are not its own."""
SIZING_ONLY = {("arpo_core.pipeline.rollouts", "generator")}
"""Functions whose reads only size an engine (vLLM's images per prompt: the longest step limit of every
stage), which changes no result."""


def _module_path(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _chain(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`p.a.b.c` -> 'a.b.c'; `x.c` with `x = p.a.b` in the function -> 'a.b.c'."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    if node.id == "p" and parts:
        return ".".join(reversed(parts))
    if node.id in aliases and parts:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _function_reads(fn: ast.FunctionDef) -> tuple[set[str], set[str]]:
    """(params keys read in `fn`, names it loads)."""
    parents = {c: n for n in ast.walk(fn) for c in ast.iter_child_nodes(n)}
    aliases: dict[str, str] = {}
    alias_values: set[ast.AST] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            c = _chain(n.value, {}) if isinstance(n.value, ast.Attribute) else None
            if c:
                aliases[n.targets[0].id] = c
                alias_values.add(n.value)
    reads: set[str] = set()
    names: set[str] = set()
    for n in ast.walk(fn):
        if (
            isinstance(n, ast.Attribute)
            and n not in alias_values
            and not isinstance(parents.get(n), ast.Attribute)
        ):
            c = _chain(n, aliases)
            if c:
                reads.add(c)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            names.add(n.id)
            if n.id in aliases and not isinstance(parents.get(n), ast.Attribute):
                reads.add(aliases[n.id])  # the alias used whole: `tokens = p.policy.max_new_tokens`
    return reads, names


def stage_reads(stage: Stage) -> dict[str, set[str]]:
    """Params key -> the functions reading it: from the stage's `run`, every function of arpo_core's
    pipeline package it names, transitively (the pipeline layer is where `p` is read; below it the
    library takes config sections and values)."""
    out: dict[str, set[str]] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(stage.module, stage.run.__name__)]
    while todo:
        module, name = todo.pop()
        if (module, name) in seen:
            continue
        seen.add((module, name))
        tree = ast.parse(_module_path(module).read_text())
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        imported = {
            a.asname or a.name: (n.module, a.name)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("arpo_core.pipeline.")
            for a in n.names
        }
        if name not in funcs:
            continue
        reads, names = _function_reads(funcs[name])
        if (module, name) not in SIZING_ONLY:
            for key in reads:
                out.setdefault(key, set()).add(f"{module.rsplit('.', 1)[-1]}.{name}")
        todo += [(module, n) for n in names if n in funcs]
        todo += [imported[n] for n in names if n in imported]
    return out


def _covered(key: str, declared: tuple[str, ...]) -> bool:
    return any(key == d or key.startswith(d + ".") for d in declared)


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_a_stage_declares_every_params_key_its_code_reads(stage):
    """Changing any key a stage reads re-runs it (under DVC and `arpo run`): `ground` read
    policy.max_new_tokens without declaring it, so changing it re-ran nothing."""
    missing = {
        key: sorted(where)
        for key, where in stage_reads(stage).items()
        if not _covered(key, stage.params)
        and not _covered(key, OPERATIONAL)
        and not (key.split(".")[0] in OFFLINE_SECTIONS and key.split(".")[0] != stage.name)
    }
    assert missing == {}, f"{stage.name} reads params keys its stage object does not list: {missing}"


def test_the_read_walk_follows_calls_aliases_and_imports():
    """The walk must see what the test above relies on: a read behind an alias (`e = p.evaluate`), in a
    helper of the same module, and in a function imported from another pipeline module."""
    by_name = {s.name: s for s in STAGES}
    train = stage_reads(by_name["train"])
    assert "evaluate.during_training_episodes" in train  # train._evaluator: e = p.evaluate; e.during_...
    assert "project.torch_threads" in train  # common.setup_torch, imported
    assert "train.max_steps" not in stage_reads(by_name["baseline"])  # rollouts.generator: sizing only
    assert "policy.max_new_tokens" in stage_reads(by_name["ground"])


def test_operational_keys_are_real_keys_and_in_no_stage():
    """OPERATIONAL names keys of params.yaml, and no stage lists one (they would re-run it)."""
    import yaml

    tree = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key in OPERATIONAL:
        node = tree
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"OPERATIONAL names {key}, not in params.yaml"
            node = node[part]
    for s in STAGES:
        assert not [k for k in s.params if _covered(k, OPERATIONAL)], s.name


def test_the_table_holds_the_stage_objects_of_their_modules():
    """Every row is the object its module exports, and `run` is the module's own function."""
    import importlib

    for s in STAGES:
        mod = importlib.import_module(s.module)
        exported = getattr(mod, "STAGES", None) or (mod.STAGE,)
        assert s in exported and s.run is mod.run, s.name


def test_no_front_door_looks_a_module_up_by_name():
    """No `import_module` / `__import__` in tasks/ or flows/ (stage objects are imported directly)."""
    for path in sorted([*(ROOT / "tasks").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute | ast.Name):
                name = node.attr if isinstance(node, ast.Attribute) else node.id
                assert name not in {"import_module", "__import__"}, f"{path.relative_to(ROOT)}:{node.lineno}"
