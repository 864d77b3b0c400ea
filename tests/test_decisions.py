"""Design decisions are cited by name, and every citation resolves (docs/design.md).

A module's docstring may hold a list headed `Decisions:` or `Design decisions:` whose items are bullets
with a bold name, `- **Exact micro-batching.** Each micro-batch's loss is weighted ...`. Elsewhere a
decision is cited by that name: `decision "Exact micro-batching"`, `decisions "A", "B" and "C"`. The
file a citation points at is the nearest `<name>.py` (a basename or a path) written before it on the
same line or in the same sentence, else the citing file itself: `trainer.py, decision "Checkpoint
integrity"` in any file, `decision "Checkpoint integrity"` inside trainer.py. Numbers are not citations
any more (they shifted whenever a list was edited): `decision 3`, `decisions 2-4` and `dec. 2` fail.

The parser and the resolver are plain functions on text, unit-tested below on hand-written strings;
the repository tests run them over every tracked file. This file is not scanned for citations: its
examples are made up.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = "tests/test_decisions.py"
LIST_DIRS = ("arpo_core/", "flows/", "tasks/", "tracking/", "benchmarks/", "scripts/", "tests/")
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".toml")
TEXT_NAMES = ("Makefile", ".gitignore", ".dvcignore")

HEADING = re.compile(r"^(?P<indent>[ \t]*)(?:Design d|D)ecisions:[ \t]*$")
BOLD_ITEM = re.compile(r"- \*\*(?P<name>[^*\n]+?)\.\*\*(?=\s|$)")
NUMBERED_ITEM = re.compile(r"\d+[.)]\s")
QUOTED = r'"[^"\n]+"'
GAP = r"(?:\s|#)*"  # a list of names may go on over a line break, also in a comment
SEPARATOR = rf"(?:\s*,{GAP}(?:(?:and|or)\s{GAP})?|\s{GAP}(?:and|or)\s{GAP})"
CITATION = re.compile(rf"\b[Dd]ecisions?\s+(?P<names>{QUOTED}(?:{SEPARATOR}{QUOTED})*)")
NUMERIC_CITATION = re.compile(r"\b(?:[Dd]ecisions?|[Dd]ec\.)[ \t]*(?:\n[ \t]*#?)?[ \t]*#?\d")
PY_MENTION = re.compile(r"(?<![\w/.-])(?P<path>(?:[\w.-]+/)*[\w-]+\.py)\b")
# A sentence ends at a full stop, a blank line or a docstring's quotes; a comment block after a line of
# code starts a new one.
SENTENCE_END = re.compile(
    r"[.!?][)\]\"'*`]*(?=\s)|\n[ \t]*(?:#[ \t]*)?\n|\"\"\"|^[ \t]*[^#\s][^\n]*\n(?=[ \t]*#)", re.M
)


def parse_decisions(text: str) -> tuple[list[str], list[str]]:
    """The names of every decisions list in `text`, in order, and the problems found (a list item
    without a bold name, as `line N: ...`). A list is the heading line's following lines: items start
    at the heading's indentation, continuation lines are indented deeper; the list ends at a line
    indented less, at another line at the heading's indentation, or after the docstring's end."""
    names: list[str] = []
    problems: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        heading = HEADING.match(line)
        if not heading:
            continue
        indent = len(heading["indent"].expandtabs())
        for j in range(i + 1, len(lines)):
            row = lines[j]
            body = row.strip()
            if not body:
                continue
            lead = len(row.expandtabs()) - len(row.expandtabs().lstrip())
            if lead < indent or body.startswith('"""'):
                break
            if lead == indent:
                if not (body.startswith("- ") or NUMBERED_ITEM.match(body)):
                    break  # a paragraph after the list
                item = BOLD_ITEM.match(body)
                if item:
                    names.append(item["name"].strip())
                else:
                    problems.append(f"line {j + 1}: decision without a bold name: {body[:70]!r}")
            if '"""' in body:
                break
    return names, problems


def duplicates(names: list[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({n for n in names if n in seen or seen.add(n)})


def citations(text: str) -> list[tuple[int, list[str]]]:
    """(offset, names) of every by-name citation in `text`."""
    return [(m.start(), re.findall(r'"([^"\n]+)"', m["names"])) for m in CITATION.finditer(text)]


def numeric_citations(text: str) -> list[tuple[int, str]]:
    """(line number, the line) of every citation by number left in `text`."""
    return [
        (text.count("\n", 0, m.start()) + 1, text.splitlines()[text.count("\n", 0, m.start())].strip())
        for m in NUMERIC_CITATION.finditer(text)
    ]


def cited_path(text: str, offset: int) -> str | None:
    """The nearest `<name>.py` mentioned before `offset` on the same line or in the same sentence
    (whichever reaches further back), or None when there is none."""
    line_start = text.rfind("\n", 0, offset) + 1
    sentence_start = 0
    for end in SENTENCE_END.finditer(text, 0, offset):
        sentence_start = end.end()
    mentions = list(PY_MENTION.finditer(text, min(line_start, sentence_start), offset))
    return mentions[-1]["path"] if mentions else None


def resolve(mention: str | None, citing: str, files: list[str]) -> str | None:
    """The tracked file a citation in `citing` points at: the one whose path ends with `mention` (a
    basename or a path, matched on whole path components), else `citing` itself; None when the
    mention matches no file or several."""
    if mention is None:
        return citing
    hits = [f for f in files if f == mention or f.endswith("/" + mention)]
    return hits[0] if len(hits) == 1 else None


def check_citations(text: str, citing: str, decisions: dict[str, set[str]], files: list[str]) -> list[str]:
    """One message per citation in `text` (the file `citing`) that does not resolve."""
    errors = []
    for offset, names in citations(text):
        where = f"{citing}:{text.count(chr(10), 0, offset) + 1}"
        mention = cited_path(text, offset)
        target = resolve(mention, citing, files)
        if target is None:
            errors.append(f"{where}: cites {mention!r}, which names no single tracked file")
            continue
        known = decisions.get(target)
        if known is None:
            errors.append(f"{where}: cites decisions of {target}, which has no decisions list")
            continue
        errors += [f"{where}: {target} has no decision {n!r}" for n in names if n not in known]
    return errors


# ---- the repository --------------------------------------------------------------------------------


def _tracked() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sorted(p for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def _repo_decisions(tracked: list[str]) -> tuple[dict[str, set[str]], list[str]]:
    decisions: dict[str, set[str]] = {}
    problems: list[str] = []
    for rel in tracked:
        if not (rel.endswith(".py") and rel.startswith(LIST_DIRS)) or rel == SELF:
            continue
        names, found = parse_decisions((ROOT / rel).read_text(encoding="utf-8"))
        problems += [f"{rel}: {p}" for p in found]
        problems += [f"{rel}: decision {n!r} named twice" for n in duplicates(names)]
        if names:
            decisions[rel] = set(names)
    return decisions, problems


def _text_files(tracked: list[str]) -> list[str]:
    return [
        rel for rel in tracked if (rel.endswith(TEXT_SUFFIXES) or rel.endswith(TEXT_NAMES)) and rel != SELF
    ]


def test_every_decision_has_a_unique_bold_name():
    decisions, problems = _repo_decisions(_tracked())
    assert not problems, "\n".join(problems)
    assert len(decisions) >= 40, sorted(decisions)  # the lists were found at all


def test_every_citation_resolves():
    tracked = _tracked()
    decisions, _ = _repo_decisions(tracked)
    errors: list[str] = []
    count = 0
    for rel in _text_files(tracked):
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        count += len(citations(text))
        errors += check_citations(text, rel, decisions, tracked)
    assert not errors, f"{len(errors)} unresolved citations:\n" + "\n".join(errors)
    assert count >= 300, count  # the scan saw the citations at all


def test_no_citation_by_number():
    tracked = _tracked()
    left = [
        f"{rel}:{line}: {row}"
        for rel in _text_files(tracked)
        for line, row in numeric_citations((ROOT / rel).read_text(encoding="utf-8", errors="replace"))
    ]
    assert not left, "cite decisions by name, not number:\n" + "\n".join(left)


# ---- the parser and the resolver on hand-written text ----------------------------------------------

MODULE = '''"""A module.

Design decisions:
- **Exact micro-batching.** Each micro-batch's loss is weighted so that
  the sum equals the whole batch:
      loss = sum_i w_i * l_i
- **Checkpoint integrity.** A manifest comes last; see decision "Exact micro-batching".
After the list, prose.
"""
'''

FILES = ["arpo_core/algorithm/trainer.py", "arpo_core/algorithm/update.py", "arpo_core/config/__init__.py"]
DECISIONS = {
    "arpo_core/algorithm/trainer.py": {"Checkpoint integrity", "Buffer preload"},
    "arpo_core/algorithm/update.py": {"Exact micro-batching"},
}


def test_parse_reads_bold_names_and_skips_continuations():
    assert parse_decisions(MODULE) == (["Exact micro-batching", "Checkpoint integrity"], [])


def test_parse_reports_an_item_without_a_name_and_a_duplicate():
    text = 'Decisions:\n1. Numbered, no name.\n- **A.** x\n- plain bullet\n- **A.** y\n"""'
    names, problems = parse_decisions(text)
    assert names == ["A", "A"] and duplicates(names) == ["A"]
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 4"]


def test_parse_handles_an_indented_list_and_ends_at_the_docstring():
    text = '    Decisions:\n    - **One.** a\n      b."""\n    - **Not an item.** after the docstring'
    assert parse_decisions(text) == (["One"], [])


def test_citation_forms():
    text = 'as decision "A" says; decisions "B", "C" and "D"; Decisions "E" or "F"; decision 7'
    assert [names for _, names in citations(text)] == [["A"], ["B", "C", "D"], ["E", "F"]]
    text = '# see decisions "A", "B",\n# "C" and\n    # "D"; a "quote" is not a name'
    assert [names for _, names in citations(text)] == [["A", "B", "C", "D"]]


def test_numeric_citations_are_found():
    text = "x (decision 3)\ny decisions 2-4\nz (dec. 2)\nno decision here\nDecision 12: w\n# a decision\n# 7 here"
    assert [line for line, _ in numeric_citations(text)] == [1, 2, 3, 5, 6]


def test_target_is_the_nearest_file_of_the_line_or_sentence():
    text = 'Read by rollout.py and trainer.py, decision "Buffer preload".'
    assert cited_path(text, text.index("decision")) == "trainer.py"
    text = '# As in arpo_core/algorithm/update.py (the weighting,\n# decision "Exact micro-batching").'
    assert cited_path(text, text.index("decision")) == "arpo_core/algorithm/update.py"
    text = 'Seen in update.py. Here\n# decision "Checkpoint integrity" is ours.'
    assert cited_path(text, text.index("decision")) is None  # another sentence: the citing file
    text = 'Seen in update.py. Here decision "Exact micro-batching" is its.'
    assert cited_path(text, text.index("decision")) == "update.py"  # the same line
    text = 'From update.py\n\nour own decision "X"'
    assert cited_path(text, text.index("decision")) is None  # a blank line ends a sentence
    text = 'x = "engines.py"  # not a citation\n# ours: decision "X"'
    assert cited_path(text, text.index("decision")) is None  # a comment block after code starts anew


def test_resolve_matches_whole_path_components():
    assert resolve("trainer.py", "docs/x.md", FILES) == "arpo_core/algorithm/trainer.py"
    assert resolve("algorithm/update.py", "docs/x.md", FILES) == "arpo_core/algorithm/update.py"
    assert resolve("config/__init__.py", "docs/x.md", FILES) == "arpo_core/config/__init__.py"
    assert resolve("rainer.py", "docs/x.md", FILES) is None
    assert resolve(None, "arpo_core/algorithm/update.py", FILES) == "arpo_core/algorithm/update.py"


def test_check_accepts_known_names():
    text = 'trainer.py, decisions "Checkpoint integrity" and "Buffer preload"; update.py, decision "Exact micro-batching".'
    assert check_citations(text, "docs/x.md", DECISIONS, FILES) == []
    own = 'the weights (decision "Exact micro-batching")'
    assert check_citations(own, "arpo_core/algorithm/update.py", DECISIONS, FILES) == []


def test_check_reports_an_unknown_name_with_file_and_line():
    text = 'intro\nsee trainer.py, decisions "Buffer preload" and "Checkpoint integrty".'
    assert check_citations(text, "docs/x.md", DECISIONS, FILES) == [
        "docs/x.md:2: arpo_core/algorithm/trainer.py has no decision 'Checkpoint integrty'"
    ]


def test_check_reports_a_file_without_decisions_and_an_unknown_file():
    text = 'as config/__init__.py, decision "A". And nowhere.py, decision "B".\nOurs: decision "C".'
    assert check_citations(text, "docs/x.md", DECISIONS, FILES) == [
        "docs/x.md:1: cites decisions of arpo_core/config/__init__.py, which has no decisions list",
        "docs/x.md:1: cites 'nowhere.py', which names no single tracked file",
        "docs/x.md:2: cites decisions of docs/x.md, which has no decisions list",
    ]
