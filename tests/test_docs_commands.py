"""Every shell command block in README.md and docs/*.md is checked against the code, so the docs cannot
drift (issue 17 item 6):

- each `arpo` command: the subcommand exists, every option it uses is one of that subcommand's options,
  a `--preset` names a file in presets/, a `-S/--set key=value` names a params key, a stage name is a
  stage; the cheap ones (`arpo params ...`, `arpo dvc-yaml --check`) are executed in a project copy;
- each `dvc` command: the subcommand and every option exist (`dvc <sub> --help`), `-S` keys are params;
- each `prefect deployment run arpo-train/<name>`: the deployment is in prefect.yaml;
- each `scripts/...` and `source ...` path exists.
The expensive commands (runs, servers, `dvc repro`) are run by the slow tests of test_flows.py and
test_dvc.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import click
import pytest
import typer
import yaml

from arpo_core.config import load_params, to_dict
from arpo_core.pipeline.table import STAGE_NAMES
from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line inside a bash/sh fenced block of `path`."""
    out, inside = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = bool(FENCE.match(line)) if not inside else False
            continue
        if inside:
            out.append((i, line))
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: comments dropped, split at &&, ||, ;, | and `do`."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose-like lines is a doc bug
        raise AssertionError(f"cannot parse shell line: {line!r}") from None
    cmds, cur = [], []
    for tok in tokens:
        if tok in ("&&", "||", ";", "|", "do", "then", "done", "fi") or tok.endswith(";"):
            if tok.endswith(";") and tok != ";":
                cur.append(tok[:-1])
            if cur:
                cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    if cur:
        cmds.append(cur)
    return cmds


INLINE = re.compile(r"`((?:arpo|dvc|make) [^`]+)`")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*|<[^>]*>|.*\.\.\..*|.*[<>].*|k=v")
"""A value the docs leave to the reader (`arpo stage NAME`, `--preset X`, `arpo-train/<name>`)."""


def doc_commands() -> list[tuple[str, list[str]]]:
    """('file:line', argv) of every command in the docs' shell blocks, and of every inline code span
    in their prose that is an `arpo`, `dvc` or `make` command."""
    found = []
    for path in DOCS:
        inside = {n for n, _ in shell_blocks(path)}
        for n, line in shell_blocks(path):
            for argv in commands(line):
                found.append((f"{path.relative_to(ROOT)}:{n}", argv))
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if n not in inside:
                for span in INLINE.findall(line):
                    for argv in commands(span):
                        found.append((f"{path.relative_to(ROOT)}:{n} (inline)", argv))
    return found


ALL = doc_commands()
ARPO = [(where, argv) for where, argv in ALL if argv[0] in ("arpo", ".venv/bin/arpo")]
DVC = [(where, argv) for where, argv in ALL if argv[0] == "dvc"]


def test_docs_have_the_commands_this_test_checks():
    assert len(ARPO) >= 20 and len(DVC) >= 15, (len(ARPO), len(DVC))
    assert any(argv[:2] == ["dvc", "repro"] for _, argv in DVC)
    assert any(w.startswith("README.md") for w, _ in ARPO)


def test_make_targets_in_docs_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    used = [(w, argv) for w, argv in ALL if argv[0] == "make"]
    assert used
    for where, argv in used:
        for target in argv[1:]:
            assert target in targets, f"{where}: make {target}"


# ------------------------------------------------------------------------------------------------
# arpo


def _options(cmd: click.Command) -> dict[str, click.Parameter]:
    return {opt: p for p in cmd.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")}


ROOT_CMD = typer.main.get_command(app)
PARAMS = to_dict(load_params(ROOT / "params.yaml"))


def _has_key(dotted: str) -> bool:
    node = PARAMS
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def check_arpo(argv: list[str]) -> None:
    args = argv[1:]
    root_opts = _options(ROOT_CMD)
    while args and args[0] in root_opts:  # arpo --debug ...
        args = args[1:]
    assert args, "no subcommand"
    if PLACEHOLDER.fullmatch(args[0]):  # `arpo --debug <command>`, `arpo --debug ...`
        return
    sub = ROOT_CMD.commands.get(args[0])
    assert sub is not None, f"unknown subcommand {args[0]!r}; has {sorted(ROOT_CMD.commands)}"
    opts = _options(sub)
    positional = [p for p in sub.params if isinstance(p, click.Argument)]
    i, rest = 1, []
    while i < len(args):
        tok = args[i]
        if tok.startswith("-"):
            name, _, inline = tok.partition("=")
            assert name in opts, f"arpo {args[0]}: no option {name}; has {sorted(opts)}"
            param = opts[name]
            value = None
            if not getattr(param, "is_flag", False):
                if not inline and i + 1 == len(args):  # prose naming the option (`arpo run -S`)
                    break
                value = inline or args[i + 1]
                i += 0 if inline else 1
                if PLACEHOLDER.fullmatch(value):
                    i += 1
                    continue
            if name == "--preset":
                assert (ROOT / "presets" / f"{value}.yaml").exists(), f"no preset {value!r}"
            if name in ("-S", "--set"):
                key = value.partition("=")[0]
                assert _has_key(key), f"no params key {key!r}"
            if name in ("-s", "--stage"):
                assert value in (*STAGE_NAMES, "pipeline"), f"no stage {value!r}"
            if name in ("-p", "--params"):
                assert (ROOT / value).exists() or value.startswith("$"), value
        else:
            rest.append(tok)
        i += 1
    if args[0] == "stage":
        assert rest and (rest[0] in STAGE_NAMES or PLACEHOLDER.fullmatch(rest[0])), rest
    assert len(rest) <= max(1, len(positional)) or any(p.nargs == -1 for p in positional), rest


@pytest.mark.parametrize(("where", "argv"), ARPO, ids=[w for w, _ in ARPO])
def test_arpo_command_in_docs_exists(where, argv):
    check_arpo(argv)


def test_check_arpo_catches_drift():
    """The checker fails on what drifted docs would contain (so a passing run means something)."""
    for bad in (
        ["arpo", "trian"],
        ["arpo", "run", "--preset", "nosuch"],
        ["arpo", "run", "--forse"],
        ["arpo", "params", "-S", "train.replay.enabeld=false"],
        ["arpo", "stage", "nosuch"],
        ["arpo", "runs", "-s", "evaluat"],
    ):
        with pytest.raises(AssertionError):
            check_arpo(bad)
    check_arpo(["arpo", "--debug", "run", "--preset", "quick", "-S", "train.optimizer.lr=0.001", "--force"])


def _project_copy(tmp_path: Path) -> Path:
    for rel in ("params.yaml", "presets", "data/suites", "data/osworld", "assets/checkpoints", "dvc.yaml"):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    return tmp_path


CHEAP = [
    (where, argv)
    for where, argv in ARPO
    if (argv[1] == "params" or argv[1:] == ["dvc-yaml", "--check"] or argv[1:] == ["--help"])
    and not any(PLACEHOLDER.fullmatch(tok) for tok in argv)
]


@pytest.mark.parametrize(("where", "argv"), CHEAP, ids=[w for w, _ in CHEAP])
def test_cheap_arpo_commands_in_docs_run(where, argv, tmp_path):
    """`arpo params ...` (e.g. `--preset replay-study --out params.yaml`) and `arpo dvc-yaml --check` run
    as written, in a copy of the project."""
    project = _project_copy(tmp_path)
    res = subprocess.run(
        [str(VENV_BIN / "arpo"), *argv[1:]], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, f"{where}: {' '.join(argv)}\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
    if "--out" in argv:
        out = project / argv[argv.index("--out") + 1]
        assert yaml.safe_load(out.read_text())["project"]["name"]


def test_cheap_commands_include_the_documented_preset_to_params_file():
    assert any("--out" in argv and "params.yaml" in argv for _, argv in CHEAP)


# ------------------------------------------------------------------------------------------------
# dvc, prefect, scripts


@cache
def dvc_options(*sub: str) -> tuple[str, ...]:
    """Every option `dvc <sub> --help` lists; fails when the subcommand does not exist."""
    res = subprocess.run(
        [str(VENV_BIN / "dvc"), *sub, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, f"dvc {' '.join(sub)}: {res.stderr[-500:]}"
    return tuple(sorted(set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", res.stdout))))


DVC_GROUPS = {"exp", "metrics", "plots", "remote", "cache", "config", "stage", "queue"}


def check_dvc(argv: list[str]) -> None:
    sub = argv[1:3] if argv[1] in DVC_GROUPS else argv[1:2]
    opts = dvc_options(*sub)
    args = argv[1 + len(sub) :]
    for i, tok in enumerate(args):
        if tok.startswith("-") and tok != "-":
            name = tok.partition("=")[0]
            assert name in opts, f"dvc {' '.join(sub)}: no option {name}"
            if name in ("-S", "--set-param") and i + 1 < len(args) and not PLACEHOLDER.fullmatch(args[i + 1]):
                key = args[i + 1].partition("=")[0]
                assert _has_key(key), f"no params key {key!r}"


@pytest.mark.parametrize(("where", "argv"), DVC, ids=[w for w, _ in DVC])
def test_dvc_command_in_docs_exists(where, argv):
    check_dvc(argv)


def test_check_dvc_catches_drift():
    for bad in (
        ["dvc", "exp", "shoe"],
        ["dvc", "exp", "show", "--only-changd"],
        ["dvc", "exp", "run", "-S", "train.replay.enabeld=false"],
    ):
        with pytest.raises(AssertionError):
            check_dvc(bad)


def test_prefect_deployments_and_scripts_in_docs_exist():
    deployments = {d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    seen = 0
    for where, argv in ALL:
        if argv[:3] == ["prefect", "deployment", "run"]:
            flow, _, name = argv[3].partition("/")
            assert flow == "arpo-train", f"{where}: {argv[3]}"
            assert name in deployments or PLACEHOLDER.fullmatch(name), f"{where}: {argv[3]}"
            seen += 1
        for tok in argv:
            if tok.startswith(("scripts/", ".venv/bin/")) and not tok.startswith(".venv/bin/python"):
                assert (ROOT / tok).exists() or tok.startswith(".venv/"), f"{where}: {tok}"
        if argv[0] == "source":
            assert (ROOT / argv[1]).exists(), f"{where}: {argv[1]}"
    assert seen >= 4


def test_the_readme_is_a_front_door():
    """Issue 30 item 5: under 120 lines, with the table the main job prints (dated, with its commit), the
    main job's and the test suite's measured times; the measurements live in docs/results.md."""
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 120
    assert "## What the main job prints" in text
    section = text.split("## What the main job prints", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"20\d\d-\d\d-\d\d, commit [0-9a-f]{7}", section)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert {r.split("|")[1].strip() for r in rows} >= {"base", "rft", "dpo", "kto", "arpo"}
    assert re.search(r"`make run` took \d+ min", text) and re.search(
        r"`make test` on a clean clone: \d+ min", text
    )
    assert (ROOT / "docs" / "results.md").exists() and "docs/results.md" in text
