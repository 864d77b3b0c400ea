"""TaskSpec, the suite loader and the two MiniWoB suite files (no browser needed)."""

from pathlib import Path

import pytest

from arpo_core.envs.base import GuiEnv, TaskSpec, load_suite
from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv
from arpo_core.envs.miniwob.oracles import ORACLES

SUITES = Path(__file__).resolve().parents[1] / "data" / "suites"


def test_taskspec_key_and_hash_ignore_config():
    a = TaskSpec("chrome", "abc", config={"x": 1})
    b = TaskSpec("chrome", "abc", config={"x": 2})
    assert a.key == ("chrome", "abc")
    assert a == b and hash(a) == hash(b)
    assert TaskSpec("gimp", "abc").key != a.key  # same id, other domain: another task
    with pytest.raises(AttributeError):
        a.task_id = "other"  # frozen


def test_miniwob_env_satisfies_protocol():
    assert isinstance(MiniWoBEnv(), GuiEnv)  # no browser starts before the first reset


def test_load_suite_defaults_and_overrides(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(
        "domain: miniwob\nsplit: out_of_domain\nconfig: {data_mode: train}\n"
        "tasks:\n  - click-test\n  - {task_id: x, feasible: false, config: {k: 1}, note: why}\n"
    )
    specs = load_suite(p)
    assert specs[0] == TaskSpec("miniwob", "click-test", split="out_of_domain")
    assert specs[0].config == {"data_mode": "train"} and specs[0].feasible
    assert specs[1].task_id == "x" and specs[1].feasible is False
    assert specs[1].config == {"data_mode": "train", "k": 1}
    assert specs[1].split == "out_of_domain"


@pytest.mark.parametrize(
    "body, message",
    [
        ("tasks: [a]\nbogus: 1\n", "bogus"),
        ("tasks:\n  - {task_id: a, colour: red}\n", "colour"),
        ("tasks:\n  - {feasible: true}\n", "no task_id"),
        ("tasks: [a, a]\n", "duplicate"),
        ("- a\n", "mapping"),
    ],
)
def test_load_suite_rejects_bad_files_naming_the_problem(tmp_path, body, message):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(ValueError, match=message) as e:
        load_suite(p)
    assert str(p) in str(e.value)


def test_suite_files_split_oracle_tasks_from_unseen_tasks():
    ind = load_suite(SUITES / "miniwob_in_domain.yaml")
    ood = load_suite(SUITES / "miniwob_out_of_domain.yaml")
    assert 16 <= len(ind) <= 24
    assert {s.split for s in ind} == {"in_domain"} and {s.split for s in ood} == {"out_of_domain"}
    # in-domain = the tasks with oracles (they produce the demos); out-of-domain has no demos
    assert {s.task_id for s in ind} == set(ORACLES)
    assert not {s.task_id for s in ood} & set(ORACLES)
    assert len(ood) >= 10
    assert all(s.feasible and s.backend == "miniwob" for s in ind + ood)
    html = Path(__import__("miniwob").__file__).parent / "html" / "miniwob"
    for s in ind + ood:
        assert (html / f"{s.task_id}.html").exists(), s.task_id
