"""arpo_core is a library: it never imports prefect, mlflow or dvc (docs/design.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"prefect", "mlflow", "dvc"}
FILES = sorted((ROOT / "arpo_core").rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_arpo_core_does_not_import_orchestration(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_arpo_core_never_evals(tmp_path):
    """Model text is untrusted: no eval/exec anywhere in the library (docs/method.md §3)."""
    for path in FILES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"eval", "exec"}, f"{path.name}:{node.lineno} calls {node.func.id}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in FILES}


def _imports(name: str, path: Path) -> set[str]:
    """arpo_core modules that `name` imports anywhere in its file: at module level, inside functions,
    under TYPE_CHECKING. `from pkg import sub` counts as importing the submodule when one exists."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_function_level_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_inside_functions_too():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert "arpo_core.envs.miniwob.oracles" in graph["arpo_core.envs.miniwob.miniwob_env"]  # module level
    assert "arpo_core.actions" in graph["arpo_core.policy.prompt"]  # inside model_image_size


def test_no_import_cycle_among_arpo_core_modules():
    """A module may import another only if that one does not (transitively) import it back, at module
    level or inside a function: a cycle makes import order matter and hides a missing layer."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert _cycles(graph) == []


# The library's layers, bottom first (docs/design.md, "Layers"): a module may import modules of its own
# layer or below, never above. envs and policy are independent of each other (neither imports the other).
LAYERS: list[tuple[str, ...]] = [
    ("arpo_core.infra",),
    ("arpo_core.config",),
    ("arpo_core.actions", "arpo_core.trajectory", "arpo_core.rewards"),  # the shared vocabulary
    ("arpo_core.envs",),
    ("arpo_core.policy",),
    ("arpo_core.algorithm",),
    ("arpo_core.offline",),
    ("arpo_core.analysis",),
    ("arpo_core.pipeline",),
]


def _layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_every_library_module_has_a_layer():
    """Nothing sits flat at the top of arpo_core but the three vocabulary modules."""
    assert [m for m in MODULES if m != "arpo_core" and _layer(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    graph = {name: _imports(name, path) for name, path in MODULES.items() if name != "arpo_core"}
    upward = sorted(
        (name, dep)
        for name, deps in graph.items()
        for dep in deps
        if _layer(dep) > _layer(name)  # type: ignore[operator]
    )
    assert upward == []
    envs, policy = _layer("arpo_core.envs"), _layer("arpo_core.policy")
    assert not any(_layer(d) == envs for m, deps in graph.items() if _layer(m) == policy for d in deps)


def test_the_layer_check_sees_an_upward_import():
    assert _layer("arpo_core.algorithm.trainer") > _layer("arpo_core.envs.pool")  # type: ignore[operator]
    assert _layer("arpo_core.infra.fileio") < _layer("arpo_core.config.suites")  # type: ignore[operator]
    assert _layer("arpo_core.somewhere_new") is None


TRACKING = sorted((ROOT / "tracking").glob("*.py"))


@pytest.mark.parametrize("path", TRACKING, ids=lambda p: str(p.relative_to(ROOT)))
def test_tracking_is_below_the_flows(path):
    """The MLflow package is used by flows/ and the CLI; it imports neither them nor Prefect or DVC."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        assert not {n.split(".")[0] for n in names} & {"flows", "tasks", "prefect", "dvc"}, (path.name, names)


def test_no_two_modules_share_a_basename():
    """`evaluate.py` in arpo_core/ and in pipeline/ (likewise demos.py, offline_baselines.py; stages.py in flows/ and
    tasks/, study.py in flows/ and arpo_core/) made every mention of a module by file name ambiguous and
    "go to file" offer two; package `__init__.py` files aside."""
    seen: dict[str, list[str]] = {}
    for path in [*FILES, *(ROOT / "flows").glob("*.py"), *(ROOT / "tasks").glob("*.py"), *TRACKING]:
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def _loaded_after(statement: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `statement` in the project root."""
    import json
    import subprocess
    import sys

    code = f"import json, sys; {statement}; print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_reading_the_stage_table_imports_no_torch():
    """`arpo dvc-yaml`, `arpo lock` and the up-to-date check read the table: it must not pull in torch,
    transformers or a browser driver (stage modules import those inside `run`)."""
    assert (
        _loaded_after("import arpo_core.pipeline.table, flows.spec", ("torch", "transformers", "selenium"))
        == []
    )


def test_an_up_to_date_arpo_stage_imports_no_prefect_mlflow_or_torch():
    """`dvc repro` calls `arpo stage NAME` for every stage; one that is up to date loads the CLI, the run
    lock and guardian, the interrupt handler and the stamp check, and exits (flows/spec.py,
    decision "One staleness authority"). With Prefect and MLflow imported on that path each call took 15-25 s
    on a loaded 2-core machine and a `dvc repro` of twelve up-to-date stages ran past ten minutes; without
    them, 2-3 s."""
    statement = (
        "import flows.cli, flows.services, flows.spec, arpo_core.infra.guardian; "
        "from flows.services import INTERRUPTED, on_interrupt, run_lock, stop_services"
    )
    assert _loaded_after(statement, ("prefect", "mlflow", "torch", "transformers")) == []


def test_the_config_package_is_a_leaf():
    """Parsing and validating params.yaml (`arpo params`, the CLI's checks, `dvc.yaml` generation) imports
    no torch, pyarrow or PIL: the config classes of replay, selection and the offline methods live in
    arpo_core/config/sections.py, not beside the code they configure."""
    statement = "from arpo_core.config import load_params; load_params('params.yaml')"
    assert _loaded_after(statement, ("torch", "pyarrow", "PIL", "transformers")) == []
    for path in sorted((ROOT / "arpo_core" / "config").glob("*.py")):
        imported = _imports(_module_name(path), path)
        assert all(
            m.startswith("arpo_core.config") or m in {"arpo_core.config.suites", "arpo_core.infra.seeds"}
            for m in imported
        ), (
            path.name,
            imported,
        )
