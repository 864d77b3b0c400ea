"""OSWorld task files (issue 18 item 5): every file under data/osworld loads or is rejected with a
message naming the file and the field; a bad file never stops the others; fuzzed files never crash."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from arpo_core.envs.osworld.osworld_env import (
    TaskFileError,
    load_osworld_files,
    load_osworld_index,
    load_osworld_task,
)

REPO = Path(__file__).resolve().parents[1]
OSWORLD = REPO / "data" / "osworld"
EXAMPLES = OSWORLD / "evaluation_examples" / "examples"
VLC_BAD = ("a1c3ab35-02de-4999-a7ed-2fd12c972c6e", "d70666e4-7348-42c7-a06a-664094c5df3c")


def test_every_shipped_file_loads_or_is_rejected_naming_file_and_field():
    files = sorted(OSWORLD.rglob("*.json"))
    specs, rejected = load_osworld_files(files)
    assert len(specs) + len(rejected) == len(files) == 440
    reasons = dict(rejected)
    for stem in VLC_BAD:
        (path,) = [f for f in reasons if stem in f]
        assert (
            path in reasons[path]
            and "'evaluator' must be an object, got str 'evaluation_dir'" in reasons[path]
        )
    assert "'id' must be a non-empty string" in reasons[str(EXAMPLES / "template.json")]
    # the two index files are not tasks; nothing else is rejected
    assert {Path(f).name for f in reasons} == {
        f"{VLC_BAD[0]}.json",
        f"{VLC_BAD[1]}.json",
        "template.json",
        "test_all.json",
        "test_small.json",
    }
    assert len(load_osworld_index()) == 369


def _write(tmp_path: Path, name: str, content) -> Path:
    p = tmp_path / "examples" / "dom" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


GOOD = json.loads((EXAMPLES / "os" / "94d95f96-9699-4208-98ba-3c3119edf9c2.json").read_text())


def _with(**changes):
    task = copy.deepcopy(GOOD)
    for key, value in changes.items():
        if key.startswith("ev_"):
            task["evaluator"][key[3:]] = value
        else:
            task[key] = value
    return task


CASES = [
    ("evaluator_null", _with(evaluator=None), "'evaluator' must be an object, got null"),
    (
        "evaluator_str",
        _with(evaluator="evaluation_dir"),
        "'evaluator' must be an object, got str 'evaluation_dir'",
    ),
    ("config_str", _with(config="open firefox"), "'config' must be a list of steps, got str"),
    ("config_dict", _with(config={"type": "launch"}), "'config' must be a list of steps, got dict"),
    ("config_item", _with(config=[3]), "config[0] must be an object, got int"),
    ("config_type", _with(config=[{"type": None}]), "config[0].type must be a string"),
    ("config_params", _with(config=[{"type": "launch", "parameters": [1]}]), "config[0].parameters must be"),
    ("postconfig", _with(ev_postconfig="x"), "'evaluator.postconfig' must be a list"),
    ("func_int", _with(ev_func=7), "evaluator.func must be a name or a list of names, got int"),
    ("func_empty", _with(ev_func=[]), "evaluator.func must be"),
    ("result_str", _with(ev_result="file"), "evaluator.result must be an object or a list of them, got str"),
    ("expected_list", _with(ev_expected=[{"type": 1}]), "evaluator.expected.type must be a string"),
    ("no_id", {k: v for k, v in GOOD.items() if k != "id"}, "OSWorld task without 'id'"),
    ("id_list", _with(id=[1]), "'id' must be a non-empty string, got list"),
    ("instruction", _with(instruction=None), "'instruction' must be a string, got null"),
    ("toplevel_list", [GOOD], "must hold a JSON object, got list"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary content"),
    ("latin1", '{"id": "caf\xe9"}'.encode("latin-1"), "not UTF-8 text"),
    ("malformed", '{"id": "x",\n "instruction": }', "invalid JSON at line 2 column"),
    ("empty", "", "invalid JSON at line 1 column 1"),
    ("deep", "[" * 100000 + "]" * 100000, "invalid JSON"),
]


@pytest.mark.parametrize(("name", "content", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_file_is_rejected_with_file_and_field(tmp_path, name, content, message):
    path = _write(tmp_path, f"{name}.json", content)
    with pytest.raises(TaskFileError) as ei:
        load_osworld_task(path)
    assert str(path) in str(ei.value) and message in str(ei.value), str(ei.value)


def test_bad_files_do_not_stop_the_others(tmp_path):
    good = _write(tmp_path, "good.json", GOOD)
    bad = [_write(tmp_path, f"{n}.json", c) for n, c, _ in CASES[:6]]
    specs, rejected = load_osworld_files([bad[0], good, *bad[1:]])
    assert [s.task_id for s in specs] == [GOOD["id"]]
    assert [f for f, _ in rejected] == [str(b) for b in bad]


def test_index_lists_bad_and_missing_files_as_rejected(tmp_path):
    root = tmp_path / "osw"
    ex = root / "evaluation_examples"
    (ex / "examples" / "os").mkdir(parents=True)
    (ex / "examples" / "os" / "good.json").write_text(json.dumps({**GOOD, "id": "good"}))
    (ex / "examples" / "os" / "bad.json").write_text(json.dumps(_with(id="bad", evaluator=None)))
    (ex / "test_all.json").write_text(json.dumps({"os": ["bad", "missing", "good"]}))
    rejected: list = []
    specs = load_osworld_index(root, rejected=rejected)
    assert [s.task_id for s in specs] == ["good"]
    assert [Path(f).stem for f, _ in rejected] == ["bad", "missing"]
    assert "cannot read" in rejected[1][1]
    (ex / "test_all.json").write_text("[1, 2]")
    with pytest.raises(TaskFileError, match=r"test_all\.json: an index must map"):
        load_osworld_index(root)


JUNK = [None, 0, -1.5, True, "", "x", [], [None], {}, {"type": 3}, [{"type": "launch", "parameters": None}]]


def _mutate(node, rng: random.Random):
    """A copy of `node` with one random value somewhere replaced by junk or its key deleted."""
    node = copy.deepcopy(node)
    parent, key = None, None
    cur = node
    for _ in range(rng.randint(1, 4)):
        if isinstance(cur, dict) and cur:
            parent, key = cur, rng.choice(list(cur))
        elif isinstance(cur, list) and cur:
            parent, key = cur, rng.randrange(len(cur))
        else:
            break
        cur = parent[key]
    if parent is None:
        return rng.choice(JUNK)
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    else:
        parent[key] = copy.deepcopy(rng.choice(JUNK))
    return node


def test_fuzzed_task_files_load_or_are_rejected_never_crash(tmp_path):
    rng = random.Random(18)
    sources = sorted(EXAMPLES.rglob("*.json"))
    sources = [f for f in sources if f.name != "template.json"]
    outcomes = {"loaded": 0, "rejected": 0}
    for i in range(600):
        src = rng.choice(sources)
        raw = src.read_bytes()
        if i % 3 == 0:  # byte-level: truncation or a flipped byte
            cut = bytearray(raw[: rng.randrange(len(raw))])
            if cut and rng.random() < 0.5:
                cut[rng.randrange(len(cut))] = rng.randrange(256)
            content = bytes(cut)
        else:
            content = json.dumps(_mutate(json.loads(raw), rng))
        path = _write(tmp_path, f"f{i}.json", content)
        try:
            spec = load_osworld_task(path)
        except TaskFileError as e:
            assert str(path) in str(e)
            outcomes["rejected"] += 1
        else:
            assert isinstance(spec.config["unsupported"], list)
            outcomes["loaded"] += 1
    assert outcomes["loaded"] > 50 and outcomes["rejected"] > 50, outcomes
