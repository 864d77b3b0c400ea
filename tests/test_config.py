"""params.yaml <-> config dataclasses: strict parsing, overrides, and the repo's params file."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from pathlib import Path

import pytest
import yaml

from arpo_core.config import ConfigError, Params, apply_overrides, flatten, load_params, parse_params, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_repo_params_file_parses_and_lists_every_key():
    params = load_params(ROOT / "params.yaml")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    # Every dataclass field appears in params.yaml (discoverability), and nothing else does.
    assert set(flatten(raw)) == set(flatten(to_dict(params)))


def test_defaults_equal_empty_file():
    assert parse_params({}) == Params()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"trian": {}}, "unknown key 'trian' in the top level"),
        ({"train": {"epochz": 2}}, "unknown key 'epochz' in section 'train'"),
        ({"train": {"replay": {"enabeld": False}}}, "unknown key 'enabeld' in section 'train.replay'"),
        ({"train": {"epochs": "3"}}, "'train.epochs' must be an integer"),
        ({"train": {"epochs": True}}, "'train.epochs' must be an integer"),
        ({"train": {"replay": {"enabled": "no"}}}, "'train.replay.enabled' must be true or false"),
        ({"train": {"loss": {"agg": "mean"}}}, "'train.loss.agg' = 'mean' is not one of"),
        ({"train": {"replay": 3}}, "'train.replay' must be a mapping"),
        ({"select": {"max_tasks": 2.5}}, "'select.max_tasks' = 2.5 is not a"),
    ],
)
def test_bad_values_name_key_and_file(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_params(raw, file="my/params.yaml")
    assert needle in str(err.value)
    assert str(err.value).startswith("my/params.yaml:")


def test_int_accepted_for_float_and_null_for_optional():
    p = parse_params({"train": {"lr": 1, "loss": {"clip_low": 0}}, "select": {"max_tasks": None}})
    assert p.train.lr == 1.0 and isinstance(p.train.lr, float)
    assert p.train.loss.clip_low == 0.0
    assert p.select.max_tasks is None


def test_overrides_are_dotted_yaml_values(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  replay:\n    enabled: true\n")
    p = load_params(f, ["train.replay.enabled=false", "select.max_tasks=32", "train.loss.kl_coef=0.01"])
    assert p.train.replay.enabled is False
    assert p.select.max_tasks == 32
    assert p.train.loss.kl_coef == pytest.approx(0.01)
    with pytest.raises(ConfigError, match="unknown key 'enabeld'"):
        load_params(f, ["train.replay.enabeld=false"])
    with pytest.raises(ConfigError, match="must look like"):
        apply_overrides({}, ["train.replay.enabled"])


def test_overrides_do_not_mutate_input():
    raw = {"train": {"epochs": 1}}
    apply_overrides(raw, ["train.epochs=5"])
    assert raw == {"train": {"epochs": 1}}


def test_configs_are_frozen():
    p = Params()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.train.epochs = 9  # type: ignore[misc]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


def _section_classes(cls, seen=None):
    seen = seen if seen is not None else []
    if cls not in seen:
        seen.append(cls)
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                _section_classes(tp, seen)
    return seen


@pytest.mark.parametrize("cls", _section_classes(Params)[1:], ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    """Every leaf config field has a docstring line below it (cleanrl style); sections need none."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign):
            continue
        is_section = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "field"
        if is_section:
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        assert documented, f"{cls.__name__}.{node.target.id} has no docstring line"


def test_section_checks_become_config_errors():
    with pytest.raises(
        ConfigError, match=r"my.yaml: section 'select': .*cap_mode|my.yaml: 'select.cap_mode'"
    ):
        parse_params({"select": {"cap_mode": "best"}}, file="my.yaml")
    with pytest.raises(ConfigError, match=r"my\.yaml: section 'select': select min_successes must be >= 0"):
        parse_params({"select": {"min_successes": -1}}, file="my.yaml")
