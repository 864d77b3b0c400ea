"""params.yaml <-> config dataclasses: strict parsing, declared ranges, cross-field rules, provenance of every
error (params file / preset / override), overrides, and the repo's params file and presets."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import annotated_types as at
import pytest
import yaml

from arpo_core.algorithm.replay import ReplayConfig
from arpo_core.algorithm.selection import SelectConfig
from arpo_core.config import (
    ConfigError,
    GroundPhase,
    OptimizerConfig,
    Params,
    TrainConfig,
    apply_overrides,
    flatten,
    load_params,
    merge,
    parse_params,
    to_dict,
)
from arpo_core.config.check import Provenance, Source, check_fields
from arpo_core.config.sections import DPOConfig, KTOConfig, SFTConfig

ROOT = Path(__file__).resolve().parents[1]
# paper names a checkpoint that must exist: tests/test_paper_preset.py loads it with a stand-in path
PRESETS = sorted(p for p in (ROOT / "presets").glob("*.yaml") if p.stem != "paper")


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    """Path fields are checked relative to the working directory, where the stages open them."""
    monkeypatch.chdir(ROOT)


def _raw(key: str, value: Any) -> dict[str, Any]:
    """'train.loss.clip_low', 1.5 -> {'train': {'loss': {'clip_low': 1.5}}}; 'ground.phases[0].steps'
    puts the key into the first (only) item of the list."""
    head, _, rest = key.partition(".")
    if head.endswith("[0]"):
        return {head[:-3]: [_raw(rest, value)]}
    return {head: _raw(rest, value) if rest else value}


def _raws(*pairs: tuple[str, Any]) -> dict[str, Any]:
    """Several keys in one raw dict; keys inside the same one-item list ('ground.phases[0].x') share the item."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        out = _merge_items(out, _raw(key, value))
    return out


def _merge_items(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = {**base}
    for k, v in over.items():  # merge() would replace lists; _raw's one-item lists are one item
        old = base.get(k)
        if isinstance(v, list) and isinstance(old, list) and len(v) == len(old) == 1:
            out[k] = [_merge_items(old[0], v[0])]
        elif isinstance(v, dict) and isinstance(old, dict):
            out[k] = _merge_items(old, v)
        else:
            out[k] = v
    return out


def _get(p: Any, key: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        p = p[int(part[1:-1])] if part.startswith("[") else getattr(p, part)
    return p


# --------------------------------------------------------------------------------------------------
# The repo's params file and presets


def test_repo_params_file_parses_and_lists_every_key():
    params = load_params(ROOT / "params.yaml")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    # Every dataclass field appears in params.yaml (discoverability), and nothing else does.
    assert set(flatten(raw)) == set(flatten(to_dict(params)))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_by_path_and_by_name(preset):
    by_path = load_params(ROOT / "params.yaml", preset=preset)
    assert load_params(ROOT / "params.yaml", preset=preset.stem) == by_path
    raw = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), yaml.safe_load(preset.read_text()))
    assert by_path == parse_params(raw)


def test_presets_mean_what_they_say():
    assert load_params(ROOT / "params.yaml", preset="grpo").train.replay.enabled is False
    assert load_params(ROOT / "params.yaml", preset="no-selection").train.use_selection is False
    recipe = load_params(ROOT / "params.yaml", preset="ground-recipe").ground
    assert recipe.checkpoint is None and len(recipe.phases) == 4 and recipe.phases[3].miniwob_seeds == 120
    aloud = load_params(ROOT / "params.yaml", preset="ground-reading-aloud").ground.phases
    control = load_params(ROOT / "params.yaml", preset="ground-reading-2l").ground.phases
    assert all(p.read_aloud for p in aloud) and not any(p.read_aloud for p in control)
    assert [dataclasses.replace(p, read_aloud=False) for p in aloud] == control  # the one lever, nothing else
    transcribe = load_params(ROOT / "params.yaml", preset="ground-reading-transcribe").ground.phases
    assert [dataclasses.replace(p, read_share=0.0) for p in transcribe] == control
    assert all(p.read_share == 0.5 for p in transcribe)
    names = load_params(ROOT / "params.yaml", preset="ground-reading-names").ground.phases
    assert [dataclasses.replace(p, name_weight=0.0, vision_lr_scale=1.0) for p in names] == control
    assert all(p.name_weight == 1.0 and p.vision_lr_scale == 0.2 for p in names)
    tower = load_params(ROOT / "params.yaml", preset="ground-reading-tower").ground.phases
    assert tower[1:] == control and tower[0].name_only and tower[0].name_weight == 1.0
    tied = load_params(ROOT / "params.yaml", preset="ground-reading-tied").ground.phases
    assert tied[0] == tower[0] and tied[1].name_only and tied[1].name_tied
    assert [dataclasses.replace(p, name_weight=0.0, name_tied=False) for p in tied[2:]] == control
    assert all(p.name_weight == 1.0 and p.name_tied and p.vision_lr_scale == 1.0 for p in tied[2:])
    synth = load_params(ROOT / "params.yaml", preset="ground-reading-synth").ground.phases
    assert synth[1:] == control[1:] and synth[0].miniwob_seeds == 0 and control[0].miniwob_seeds == 120
    assert dataclasses.replace(synth[0], miniwob_seeds=120, steps=4000, until_hit=0.8) == control[0]
    words = load_params(ROOT / "params.yaml", preset="ground-reading-words").ground.phases
    assert words[0] == tower[0] and dataclasses.replace(words[1], name_weight=0.0) == synth[0]
    assert all(p.name_weight == 1.0 for p in words) and [p.miniwob_seeds for p in words] == [0, 0, 0, 120]
    assert dataclasses.replace(words[3], name_weight=0.0, steps=4000) == control[2]
    point = load_params(ROOT / "params.yaml", preset="ground-reading-point").ground.phases
    assert point[0] == words[0] and [dataclasses.replace(p, point_weight=0.0) for p in point[1:]] == words[1:]
    assert all(p.point_weight == 0.1 for p in point[1:])
    place = load_params(ROOT / "params.yaml", preset="ground-reading-place").ground.phases
    assert place[0] == point[0] and all((p.point_weight, p.place_weight) == (1.0, 1.0) for p in place[1:])
    assert [dataclasses.replace(p, point_weight=0.1, place_weight=0.0) for p in place[1:]] == point[1:]
    with pytest.raises(ConfigError, match="name_only needs name_weight > 0"):
        load_params(ROOT / "params.yaml", ["ground.phases=[{name_only: true}]"])
    with pytest.raises(ConfigError, match="name_tied needs name_weight > 0"):
        load_params(ROOT / "params.yaml", ["ground.phases=[{name_tied: true}]"])
    with pytest.raises(ConfigError, match="name_token needs name_weight > 0"):
        load_params(ROOT / "params.yaml", ["ground.phases=[{name_token: true}]"])
    with pytest.raises(ConfigError, match="name_token and name_tied are two kinds of naming head"):
        load_params(
            ROOT / "params.yaml", ["ground.phases=[{name_weight: 1, name_token: true, name_tied: true}]"]
        )
    with pytest.raises(ConfigError, match="name_vocab 'lorem' needs name_weight > 0"):
        load_params(ROOT / "params.yaml", ["ground.phases=[{name_vocab: lorem}]"])
    with pytest.raises(ConfigError, match="name_vocab"):
        load_params(ROOT / "params.yaml", ["ground.phases=[{name_weight: 1.0, name_vocab: greek}]"])
    with pytest.raises(ConfigError, match="point_weight needs the clicks"):
        load_params(
            ROOT / "params.yaml", ["ground.phases=[{name_only: true, name_weight: 1, point_weight: 1}]"]
        )
    with pytest.raises(ConfigError, match="place_weight needs the language model"):
        load_params(
            ROOT / "params.yaml", ["ground.phases=[{name_only: true, name_weight: 1, place_weight: 1}]"]
        )


def test_carried_heads_need_a_previous_phase_with_the_same_heads():
    """grounding.py, decision "Carried heads": `carry_heads` is checked when params load, located at the
    phase that asks for it, for each head it trains."""
    named = "{name_weight: 1.0, name_only: true}"
    ok = load_params(
        ROOT / "params.yaml", [f"ground.phases=[{named}, {{name_weight: 1.0, carry_heads: true}}]"]
    )
    assert [p.carry_heads for p in ok.ground.phases] == [False, True]
    bad = {
        "[{name_weight: 1.0, carry_heads: true}]": "phases.0.carry_heads = True is not usable: the first phase",
        "[{}, {name_weight: 1.0, carry_heads: true}]": "the previous phase trains no naming head",
        "[{}, {carry_heads: true}]": "phases.1.carry_heads = True is not usable: the phase trains no head",
        f"[{named}, {{name_weight: 1.0, name_vocab: lorem, carry_heads: true}}]": "has name_vocab 'fixed', this",
        f"[{named}, {{name_weight: 1.0, spell_weight: 0.1, carry_heads: true}}]": "trains no spelling head",
        f"[{named}, {{name_weight: 1.0, name_token: true, carry_heads: true}}]": "has name_token False, this",
        "[{place_weight: 1.0}, {place_weight: 1.0, name_weight: 1.0, carry_heads: true}]": "no naming head",
        "[{place_weight: 1.0}, {place_weight: 1.0, match_weight: 1.0, carry_heads: [probe, matcher]}]": (
            "the previous phase trains no match head (match_weight 0)"
        ),
        "[{}, {place_weight: 1.0, carry_heads: [speller]}]": "carry_heads lists 'speller', which this phase",
        "[{}, {place_weight: 1.0, carry_heads: [tower]}]": "phases[1].carry_heads",
    }
    for phases, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_params(ROOT / "params.yaml", [f"ground.phases={phases}"])
    listed = "[{place_weight: 1.0}, {place_weight: 1.0, match_weight: 1.0, carry_heads: [probe]}]"
    assert load_params(ROOT / "params.yaml", [f"ground.phases={listed}"]).ground.phases[1].carry_heads == (
        "probe",
    )
    # the first phase carries from another run's checkpoint file (ground.heads_from), and only with it
    first = "ground.phases=[{place_weight: 1.0, match_weight: 1.0, carry_heads: [probe]}]"
    branched = load_params(ROOT / "params.yaml", [first, "ground.heads_from=params.yaml"])
    assert branched.ground.heads_from == "params.yaml"
    with pytest.raises(ConfigError, match=re.escape("ground.heads_from = 'models/no.pt' does not exist")):
        load_params(ROOT / "params.yaml", [first, "ground.heads_from=models/no.pt"])
    with pytest.raises(
        ConfigError,
        match=re.escape("heads_from = 'params.yaml' is not usable without the first phase's carry_heads"),
    ):
        load_params(
            ROOT / "params.yaml", ["ground.phases=[{place_weight: 1.0}]", "ground.heads_from=params.yaml"]
        )


def test_defaults_equal_empty_mapping_and_pass_every_rule():
    assert parse_params({}) == Params()
    assert parse_params(to_dict(Params()), check_paths=True) == Params()  # defaults obey their own ranges


# --------------------------------------------------------------------------------------------------
# Types and unknown keys


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"trian": {}}, "unknown key 'trian' in the top level (set by params file my/params.yaml)"),
        ({"train": {"epochz": 2}}, "unknown key 'epochz' in section 'train' (set by params file"),
        ({"train": {"replay": {"enabeld": False}}}, "unknown key 'enabeld' in section 'train.replay'"),
        ({"train": {"epochs": "3"}}, "train.epochs = '3' is not an integer"),
        ({"train": {"epochs": True}}, "train.epochs = True is not an integer"),
        ({"train": {"optimizer": {"lr": float("nan")}}}, "train.optimizer.lr = nan is not a finite number"),
        ({"train": {"optimizer": {"lr": float("inf")}}}, "train.optimizer.lr = inf is not a finite number"),
        ({"train": {"replay": {"enabled": "no"}}}, "train.replay.enabled = 'no' is not true or false"),
        ({"train": {"loss": {"agg": "mean"}}}, "train.loss.agg = 'mean' is not one of"),
        ({"train": {"replay": 3}}, "train.replay = 3 is not a section"),
        ({"select": {"max_tasks": 2.5}}, "select.max_tasks = 2.5 is not an integer or null"),
        ({"env": {"ray_resources": {"gpu": "x"}}}, "env.ray_resources.gpu = 'x' is not a number"),
        ({"env": {"kind": "webarena"}}, "env.kind = 'webarena' is not one of ['miniwob', 'osworld']"),
        ({"env": {"osworld": {"provider": "vmware"}}}, "env.osworld.provider = 'vmware' is not one of"),
        (
            {"env": {"rollout": {"mode": "lockstep"}}},
            "env.rollout.mode = 'lockstep' is not one of ['sync', 'async']",
        ),
        ({"policy": {"backend": "sglang"}}, "policy.backend = 'sglang' is not one of ['hf', 'vllm']"),
    ],
)
def test_bad_values_name_key_value_and_file(raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_params(raw, file="my/params.yaml")
    assert needle in str(err.value)
    assert "my/params.yaml" in str(err.value)


def test_int_accepted_for_float_and_null_for_optional():
    p = parse_params(
        {"train": {"optimizer": {"lr": 1}, "loss": {"clip_dual": None}}, "select": {"max_tasks": None}}
    )
    assert p.train.optimizer.lr == 1.0 and isinstance(p.train.optimizer.lr, float)
    assert p.train.loss.clip_dual is None
    assert p.select.max_tasks is None


def test_configs_are_frozen():
    p = Params()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.train.epochs = 9  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# Declared ranges: every field with a range, one rejected value and the accepted boundary

TINY = 1e-9
# (dotted key, rejected value, accepted value at or next to the boundary, other keys the accepted value needs)
RANGES: list[tuple[str, Any, Any, tuple[tuple[str, Any], ...]]] = [
    ("project.name", "", "x", ()),
    ("project.seed", -1, 0, ()),
    ("project.torch_threads", 0, 1, ()),
    ("env.n_envs", 0, 1, ()),
    ("env.episode_time_limit_s", 0, TINY, ()),
    ("env.reset_timeout_s", 0, TINY, ()),
    ("env.step_timeout_s", 0, TINY, ()),
    ("env.eval_timeout_s", 0, TINY, ()),
    ("env.reset_retries", 0, 1, ()),
    ("env.ray_resources", {"node": -0.01}, {"node": 0}, ()),
    ("env.osworld.base_urls", [""], ["http://vm-0:5000"], ()),
    ("env.osworld.health_timeout_s", 0, TINY, ()),
    ("env.osworld.screen_width", 63, 64, ()),
    ("env.osworld.screen_height", 63, 64, ()),
    ("env.osworld.settle_s", -0.1, 0, ()),
    ("env.osworld.setup_settle_s", -0.1, 0, ()),
    ("env.osworld.wait_s", -0.1, 0, ()),
    ("env.osworld.command_timeout_s", 0, TINY, ()),
    ("env.osworld.desktop_env_timeout_s", 0, TINY, ()),
    ("env.rollout.batch_wait_s", -0.01, 0, ()),
    ("env.rollout.batch_wait_s", 60.01, 60, ()),
    ("policy.history_images", 0, 1, ()),
    ("policy.max_new_tokens", 0, 1, ()),
    ("policy.vllm.gpu_memory_utilization", 0, TINY, ()),
    ("policy.vllm.gpu_memory_utilization", 1.01, 1, ()),
    ("policy.vllm.max_model_len", 255, 256, ()),
    ("init_policy.seed", -1, 0, ()),
    ("init_policy.rope_theta", 0, TINY, ()),
    ("init_policy.mrope", [2, 7], [2, 7, 7], ()),
    ("init_policy.mrope", [-1, 9, 8], [0, 8, 8], ()),
    ("ground.eval_per_level", 0, 1, (("ground.eval_levels", []),)),
    ("ground.eval_miniwob_seeds", -1, 0, ()),
    ("ground.miniwob_per_screen", 0, 1, ()),
    ("ground.checkpoint_every_s", -1, 0, ()),
    ("ground.min_pixels", 783, 784, ()),
    ("ground.phases[0].steps", 0, 1, ()),
    ("ground.phases[0].batch_size", 0, 1, ()),
    ("ground.phases[0].optimizer.lr", 0, TINY, ()),
    ("ground.phases[0].warmup_steps", -1, 0, ()),
    ("ground.phases[0].min_lr_frac", -0.1, 0, ()),
    ("ground.phases[0].min_lr_frac", 1.1, 1, ()),
    ("ground.phases[0].optimizer.weight_decay", -0.1, 0, ()),
    ("ground.phases[0].optimizer.max_grad_norm", 0, TINY, ()),
    ("ground.phases[0].mix", {}, {"box1": 1}, ()),
    ("ground.phases[0].mix", {"box1": 0}, {"box1": TINY}, ()),
    ("ground.phases[0].seed", -1, 0, ()),
    ("ground.phases[0].miniwob_seeds", -1, 0, ()),
    ("ground.phases[0].grow_after", [0, -1], [0], ()),
    ("ground.phases[0].grow_vision_after", [0, -1], [0], ()),
    ("ground.phases[0].widen_vision_to", 0, 1, ()),
    ("ground.phases[0].eval_every", -1, 0, ()),
    ("ground.phases[0].until_hit", 0, TINY, (("ground.phases[0].eval_every", 100),)),
    ("ground.phases[0].until_hit", 1.1, 1, (("ground.phases[0].eval_every", 100),)),
    ("ground.phases[0].read_share", -0.1, 0, ()),
    ("ground.phases[0].read_share", 1, 0.99, ()),
    ("ground.phases[0].name_weight", -0.1, 0, ()),
    ("ground.phases[0].point_weight", -0.1, 0, ()),
    ("ground.phases[0].point_heads", 0, 1, ()),
    ("ground.phases[0].place_weight", -0.1, 0, ()),
    ("ground.phases[0].match_weight", -0.1, 0, ()),
    ("ground.phases[0].match_warmup", -1, 0, (("ground.phases[0].match_weight", 1.0),)),
    ("ground.phases[0].match_lr_scale", 0, 1e-6, (("ground.phases[0].match_weight", 1.0),)),
    ("ground.phases[0].spell_weight", -0.1, 0, ()),
    ("ground.phases[0].vision_lr_scale", 0, 1e-6, ()),
    ("ground.phases[0].grown_lr_scale", 0, 1e-6, (("ground.phases[0].grow_after", [0]),)),
    ("demos.episodes_per_task", -1, 0, ()),
    ("demos.seed", -1, 0, ()),
    ("demos.recovery_rate", -0.1, 0, ()),
    ("demos.recovery_rate", 1.1, 1, ()),
    ("demos.max_misses", 0, 1, ()),
    ("sft.steps", 0, 1, ()),
    ("sft.batch_size", 0, 1, ()),
    ("sft.grad_accum", 0, 1, ()),
    ("sft.optimizer.lr", 0, TINY, ()),
    ("sft.warmup_steps", -1, 0, ()),
    ("sft.min_lr_frac", -0.1, 0, ()),
    ("sft.min_lr_frac", 1.1, 1, ()),
    ("sft.optimizer.weight_decay", -0.1, 0, ()),
    ("sft.optimizer.max_grad_norm", 0, TINY, ()),
    ("sft.checkpoint_every", -1, 0, ()),
    ("sft.point_weight", -0.1, 0, ()),
    ("sft.point_heads", 0, 1, ()),
    ("sft.seed", -1, 0, ()),
    ("sft.grow_after", [0, -1], [0], ()),
    ("baseline.episodes_per_task", 0, 1, ()),
    ("baseline.temperature", -0.1, 0, ()),
    ("baseline.top_p", 0, TINY, ()),
    ("baseline.top_p", 1.01, 1, ()),
    ("baseline.max_steps", 0, 1, ()),
    ("baseline.seed", -1, 0, ()),
    ("select.min_successes", -1, 0, ()),
    ("select.max_success_rate", -0.1, 0, ()),
    ("select.max_success_rate", 1.1, 1, ()),
    ("select.max_tasks", 0, 1, ()),
    ("select.seed", -1, 0, ()),
    ("train.seed", -1, 0, ()),
    ("train.epochs", 0, 1, ()),
    ("train.tasks_per_iteration", 0, 1, ()),
    ("train.group_size", 1, 2, ()),
    ("train.groups_per_task", 0, 1, ()),
    ("train.optimizer.lr", 0, TINY, ()),
    ("train.optimizer.weight_decay", -0.01, 0, ()),
    ("train.optimizer.max_grad_norm", 0, TINY, ()),
    ("train.micro_batch_size", 0, 1, ()),
    ("train.mini_batch_size", 0, 1, (("train.micro_batch_size", 1),)),
    ("train.ppo_epochs", 0, 1, ()),
    ("train.temperature", -0.1, 0, ()),
    ("train.top_p", 0, TINY, ()),
    ("train.top_p", 1.01, 1, ()),
    ("train.max_steps", 0, 1, ()),
    ("train.zero_stage", -1, 0, ()),
    ("train.zero_stage", 4, 3, ()),
    ("train.replay.capacity_per_task", 0, 1, ()),
    ("train.replay.trigger_std", 0, TINY, ()),
    ("train.replay.trigger_mean", 0, TINY, ()),
    ("train.replay.trigger_mean", 1.1, 1, ()),
    ("train.replay.seed", -1, 0, ()),
    ("train.distributed.timeout_s", 0, TINY, ()),
    ("project.success_threshold", -0.1, 0, ()),
    ("project.success_threshold", 1, 0.99, ()),
    ("train.loss.clip_low", 0, TINY, ()),
    ("train.loss.clip_low", 1, 0.999, ()),
    ("train.loss.clip_high", 0, TINY, ()),
    ("train.loss.clip_dual", 1, 1.001, ()),
    ("train.loss.kl_coef", -0.1, 0, ()),
    ("train.loss.sum_norm", 0, TINY, ()),
    ("train.loss.advantage_eps", 0, TINY, ()),
    ("train.loss.format_penalty", 0.1, 0, ()),
    ("evaluate.episodes_per_task", 0, 1, ()),
    ("evaluate.samples_per_instance", 0, 1, ()),
    ("evaluate.temperature", -0.1, 0, ()),
    ("evaluate.sampled_temperature", 0, TINY, ()),
    ("evaluate.top_p", 0, TINY, ()),
    ("evaluate.top_p", 1.01, 1, ()),
    ("evaluate.max_steps", 0, 1, ()),
    ("evaluate.seed", -1, 0, ()),
    ("evaluate.during_training", -1, 0, ()),
    ("evaluate.during_training_episodes", 0, 1, ()),
    ("rft.max_per_task", 0, 1, ()),
    ("rft.seed", -1, 0, ()),
    ("rft.sft.steps", 0, 1, ()),
    ("rft.sft.optimizer.lr", 0, TINY, ()),
    ("dpo.beta", 0, TINY, ()),
    ("dpo.label_smoothing", -0.1, 0, ()),
    ("dpo.label_smoothing", 0.5, 0.49, ()),
    ("dpo.max_pairs_per_task", 0, 1, ()),
    ("dpo.steps", 0, 1, ()),
    ("dpo.batch_size", 0, 1, (("dpo.micro_batch_size", 1),)),
    ("dpo.micro_batch_size", 0, 1, ()),
    ("dpo.optimizer.lr", 0, TINY, ()),
    ("dpo.optimizer.weight_decay", -0.1, 0, ()),
    ("dpo.optimizer.max_grad_norm", 0, TINY, ()),
    ("dpo.seed", -1, 0, ()),
    ("kto.beta", 0, TINY, ()),
    ("kto.desirable_weight", 0, TINY, ()),
    ("kto.undesirable_weight", 0, TINY, ()),
    ("kto.steps", 0, 1, ()),
    ("kto.batch_size", 1, 2, (("kto.micro_batch_size", 1),)),
    ("kto.micro_batch_size", 0, 1, ()),
    ("kto.optimizer.lr", 0, TINY, ()),
    ("kto.optimizer.weight_decay", -0.1, 0, ()),
    ("kto.optimizer.max_grad_norm", 0, TINY, ()),
    ("kto.seed", -1, 0, ()),
]


@pytest.mark.parametrize(("key", "bad", "ok", "extra"), RANGES, ids=[f"{r[0]}={r[1]!r}" for r in RANGES])
def test_range_rejects_outside_and_accepts_the_boundary(key, bad, ok, extra):
    with pytest.raises(ConfigError) as err:
        parse_params(_raws((key, bad), *extra), file="my.yaml")
    msg = str(err.value)
    # the offending key (the mapping's entry for per-value rules), its value as written, the rule, the source
    assert re.search(rf"^{re.escape(key)}(\.\w+|\[\d\])? = .+ (is out of range|is too short): must ", msg), (
        msg
    )
    assert msg.endswith("(set by params file my.yaml)"), msg
    assert _get(parse_params(_raws((key, ok), *extra)), key) == ok


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, section class) for Params and every section below it (a list item as [0])."""
    out = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        (item,) = typing.get_args(tp) if typing.get_origin(tp) is list else (None,)
        for sub, suffix in ((tp, ""), (item, "[0]")):
            if dataclasses.is_dataclass(sub):
                out += _sections(sub, f"{prefix}{f.name}{suffix}.")
    return out


def _has_rules(tp: Any) -> bool:
    if typing.get_origin(tp) is typing.Annotated:
        return True
    return any(_has_rules(a) for a in typing.get_args(tp))


def _is_numeric(tp: Any) -> bool:
    return tp in (int, float) or any(_is_numeric(a) for a in typing.get_args(tp))


NUMERIC_FIELDS = [
    f"{prefix}{f.name}"
    for prefix, cls in _sections(Params)
    for f in dataclasses.fields(cls)
    if _is_numeric(typing.get_type_hints(cls)[f.name])
]


def test_every_numeric_field_declares_a_range_and_is_tested():
    ranged = {
        f"{prefix}{name}"
        for prefix, cls in _sections(Params)
        for name, tp in typing.get_type_hints(cls, include_extras=True).items()
        if _has_rules(tp)
    }
    assert len(NUMERIC_FIELDS) > 90
    assert set(NUMERIC_FIELDS) <= ranged, set(NUMERIC_FIELDS) - ranged
    tested = {r[0] for r in RANGES}
    shared = {k.replace("rft.sft.", "sft.") for k in ranged}  # rft.sft is an SFTConfig, tested as sft.*
    paths = {"env.in_domain_suite", "env.out_of_domain_suite", "ground.checkpoint", "ground.heads_from"}
    paths |= {"init_policy.pretrained"}
    assert shared <= tested | paths, shared - tested  # paths: test_paths_must_exist_when_params_load


def test_the_issue_example_message():
    with pytest.raises(ConfigError) as err:
        load_params(ROOT / "params.yaml", ["train.loss.clip_low=1.5"])
    assert str(err.value) == (
        "train.loss.clip_low = 1.5 is out of range: must be < 1 "
        "(set by command-line override -S train.loss.clip_low=1.5)"
    )


def test_optional_ranges_say_null_is_allowed():
    with pytest.raises(
        ConfigError, match=r"train\.loss\.clip_dual = 0\.5 is out of range: must be > 1 \(or null\)"
    ):
        parse_params({"train": {"loss": {"clip_dual": 0.5}}})


# --------------------------------------------------------------------------------------------------
# Rules across fields

OSWORLD_SUITES = (
    ("env.in_domain_suite", "data/suites/osworld_local.yaml"),
    ("env.out_of_domain_suite", "data/suites/osworld_local.yaml"),
)
OSWORLD = (("env.kind", "osworld"), ("ground.eval_miniwob_seeds", 0), *OSWORLD_SUITES)


@pytest.mark.parametrize(
    ("bad", "ok", "needle"),
    [
        (
            (("train.micro_batch_size", 8), ("train.mini_batch_size", 4)),
            (("train.micro_batch_size", 4), ("train.mini_batch_size", 4)),
            r"train\.micro_batch_size = 8 is out of range: must be <= mini_batch_size \(set by params file "
            r"my\.yaml; train\.mini_batch_size = 4 set by params file my\.yaml\)",
        ),
        (
            (("train.engine", "deepspeed"), ("train.zero_stage", 3), ("train.micro_batch_size", 4)),
            (("train.engine", "deepspeed"), ("train.zero_stage", 3), ("train.micro_batch_size", 64)),
            r"train\.micro_batch_size = 4 is out of range: must be >= min\(mini_batch_size, "
            r"tasks_per_iteration \* group_size\) with DeepSpeed ZeRO-3",
        ),
        (  # groups_per_task multiplies one iteration's rollouts: min(64, 2 * 8 * 4) = 64 > 32
            (
                ("train.engine", "deepspeed"),
                ("train.zero_stage", 3),
                ("train.mini_batch_size", 64),
                ("train.micro_batch_size", 32),
                ("train.tasks_per_iteration", 2),
                ("train.groups_per_task", 4),
            ),
            (
                ("train.engine", "deepspeed"),
                ("train.zero_stage", 3),
                ("train.mini_batch_size", 64),
                ("train.micro_batch_size", 32),
                ("train.tasks_per_iteration", 2),
                ("train.groups_per_task", 2),
            ),
            r"train\.micro_batch_size = 32 is out of range: must be >= min\(mini_batch_size, "
            r"tasks_per_iteration \* groups_per_task \* group_size\) with DeepSpeed ZeRO-3",
        ),
        (
            (("dpo.micro_batch_size", 9),),
            (("dpo.micro_batch_size", 8),),
            r"dpo\.micro_batch_size = 9 is out of range: must be <= batch_size",
        ),
        (
            (("kto.micro_batch_size", 9),),
            (("kto.micro_batch_size", 8),),
            r"kto\.micro_batch_size = 9 is out of range: must be <= batch_size",
        ),
        (
            (("ground.eval_per_level", 1),),
            (("ground.eval_per_level", 1), ("ground.eval_levels", [])),
            r"ground\.eval_per_level = 1 is out of range: must be >= 2 when eval_levels is not empty",
        ),
        (
            (("select.min_successes", 17),),
            (("select.min_successes", 17), ("train.use_selection", False)),
            r"select\.min_successes = 17 is out of range: must be <= baseline\.episodes_per_task when "
            r"train\.use_selection is true.*baseline\.episodes_per_task = 16 default value",
        ),
        (  # env.kind osworld: the suites must be OSWorld suites ...
            (("env.kind", "osworld"), ("ground.eval_miniwob_seeds", 0)),
            (("env.kind", "osworld"), ("ground.eval_miniwob_seeds", 0), *OSWORLD_SUITES),
            r"env\.in_domain_suite = 'data/suites/miniwob_instances_main\.yaml' is out of range: must hold osworld "
            r"tasks when kind is osworld; the file's tasks are miniwob tasks \(default value; env\.kind = "
            r"'osworld' set by params file my\.yaml\)",
        ),
        (  # ... and MiniWoB's must be MiniWoB suites
            (("env.out_of_domain_suite", "data/suites/osworld_local.yaml"),),
            (("env.out_of_domain_suite", "data/suites/miniwob_quick_ood.yaml"),),
            r"env\.out_of_domain_suite = 'data/suites/osworld_local\.yaml' is out of range: must hold miniwob "
            r"tasks when kind is miniwob; the file's tasks are osworld tasks",
        ),
        (  # the held-out real screens of `ground` are MiniWoB pages
            (("env.kind", "osworld"), *OSWORLD_SUITES),
            (("env.kind", "osworld"), ("ground.eval_miniwob_seeds", 0), *OSWORLD_SUITES),
            r"ground\.eval_miniwob_seeds = 3 is out of range: must be 0 when env\.kind is osworld",
        ),
        (
            (*OSWORLD, ("ground.phases[0].miniwob_seeds", 2)),
            (*OSWORLD, ("ground.phases[0].miniwob_seeds", 0)),
            r"ground\.phases = .* is out of range: must have miniwob_seeds 0 in every phase when env\.kind is "
            r"osworld",
        ),
        (  # generate.py, decision "Read clicks": from the transformers model's heads, into UI-TARS pixels
            (("policy.click_readout", "cell"), ("policy.coord_mode", "relative1000")),
            (("policy.click_readout", "cell"), ("policy.coord_mode", "absolute")),
            r"policy\.click_readout = 'cell' is out of range: cell needs backend hf, action_format uitars and "
            r"coord_mode absolute",
        ),
        (  # docs/models.md: the prompt asks for the replies the grammar parses ...
            (("policy.action_format", "qwen3vl_tool_call"), ("policy.coord_mode", "relative1000")),
            (
                ("policy.action_format", "qwen3vl_tool_call"),
                ("policy.coord_mode", "relative1000"),
                ("policy.system_prompt", "qwen3vl_compact"),
                ("ground.checkpoint", None),
                ("ground.eval_levels", []),
                ("ground.eval_miniwob_seeds", 0),
            ),
            r"policy\.system_prompt = 'compact' is out of range: must ask for the replies action_format "
            r"qwen3vl_tool_call parses: qwen3vl or qwen3vl_compact",
        ),
        (
            (("policy.system_prompt", "qwen3vl"),),
            (("policy.system_prompt", "uitars"),),
            r"policy\.system_prompt = 'qwen3vl' is out of range: must ask for the replies action_format uitars "
            r"parses: uitars or compact",
        ),
        (  # ... in 0-1000 units
            (("policy.action_format", "qwen3vl_tool_call"), ("policy.system_prompt", "qwen3vl")),
            (
                ("policy.action_format", "qwen3vl_tool_call"),
                ("policy.system_prompt", "qwen3vl"),
                ("policy.coord_mode", "relative1000"),
                ("init_policy.pretrained", None),
                ("ground.eval_levels", []),
                ("ground.eval_miniwob_seeds", 0),
            ),
            r"policy\.coord_mode = 'absolute' is out of range: must be relative1000 with action_format "
            r"qwen3vl_tool_call",
        ),
        (  # the grounding recipe reads and writes UI-TARS replies
            (
                ("policy.action_format", "qwen3vl_tool_call"),
                ("policy.system_prompt", "qwen3vl"),
                ("policy.coord_mode", "relative1000"),
            ),
            (
                ("policy.action_format", "qwen3vl_tool_call"),
                ("policy.system_prompt", "qwen3vl"),
                ("policy.coord_mode", "relative1000"),
                ("ground.eval_levels", []),
                ("ground.eval_miniwob_seeds", 0),
            ),
            r"ground\.eval_levels = .* is out of range: must be empty .* with policy\.action_format "
            r"qwen3vl_tool_call: the grounding recipe writes and reads UI-TARS replies",
        ),
        (  # the pointing loss reads UI-TARS clicks in model pixels: behaviour cloning ...
            (("sft.point_weight", 1.0), ("policy.coord_mode", "relative1000")),
            (
                ("sft.point_weight", 1.0),
                ("policy.coord_mode", "relative1000"),
                ("demos.episodes_per_task", 0),
            ),
            r"sft\.point_weight = 1\.0 is out of range: must be 0 unless policy\.action_format is uitars and "
            r"policy\.coord_mode absolute",
        ),
        (  # ... and RFT's
            (("rft.sft.point_weight", 1.0), ("policy.coord_mode", "relative1000")),
            (("rft.sft.point_weight", 1.0),),
            r"rft\.sft\.point_weight = 1\.0 is out of range: must be 0 unless policy\.action_format is uitars",
        ),
        (  # the versioned grounded checkpoint is a Qwen2.5-VL model
            (("init_policy.family", "qwen3_vl"),),
            (("init_policy.family", "qwen3_vl"), ("ground.checkpoint", None)),
            r"ground\.checkpoint = 'assets/checkpoints/grounded-read-xs' is out of range: must be a qwen3_vl checkpoint "
            r"like the one init_policy\.family builds, or null; its config\.json says qwen2_5_vl",
        ),
        (  # remote desktops need URLs ...
            (*OSWORLD, ("env.osworld.provider", "remote")),
            (
                *OSWORLD,
                ("env.osworld.provider", "remote"),
                ("env.osworld.base_urls", ["http://a:5000"]),
                ("env.n_envs", 1),
            ),
            r"env\.osworld\.base_urls = \[\] is out of range: must list at least one server URL when provider "
            r"is remote",
        ),
        (  # ... one per env
            (*OSWORLD, ("env.osworld.provider", "remote"), ("env.osworld.base_urls", ["http://a:5000"])),
            (
                *OSWORLD,
                ("env.osworld.provider", "remote"),
                ("env.osworld.base_urls", ["http://a", "http://b"]),
                ("env.n_envs", 2),
            ),
            r"env\.n_envs = 8 is out of range: must be <= len\(osworld\.base_urls\) = 1 with provider remote",
        ),
    ],
)
def test_cross_field_rules(bad, ok, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_params(_raws(*bad), file="my.yaml")
    parse_params(_raws(*ok))


def test_osworld_rules_hold_only_when_the_desktops_are_used():
    """env.osworld is read only with env.kind osworld: a MiniWoB run ignores its remote settings."""
    p = parse_params(_raws(("env.osworld.provider", "remote")))
    assert p.env.kind == "miniwob" and p.env.osworld.base_urls == []


# --------------------------------------------------------------------------------------------------
# Provenance: the message names where the value came from


def test_optimizer_is_one_sub_section_and_a_partial_one_keeps_the_sections_defaults():
    """Every training section declares its optimizer through the one `OptimizerConfig`; a sub-section given
    in part takes the rest from its section's default (train's weight decay 1e-2, ground's bf16), not from
    `OptimizerConfig`'s; a key from before the sub-section existed names where it lives now."""
    p = parse_params(
        {"train": {"optimizer": {"lr": 1e-5}}, "ground": {"phases": [{"optimizer": {"lr": 0.5}}]}}
    )
    assert p.train.optimizer == OptimizerConfig(lr=1e-5, weight_decay=1e-2, max_grad_norm=1.0, bf16=False)
    assert p.ground.phases[0].optimizer == OptimizerConfig(lr=0.5, bf16=True)
    assert parse_params({"sft": {"optimizer": {"bf16": True}}}).sft.optimizer == OptimizerConfig(
        lr=1e-3, bf16=True
    )
    for section in (Params, TrainConfig, SFTConfig, DPOConfig, KTOConfig, GroundPhase):
        names = {f.name for f in dataclasses.fields(section)}
        assert not names & {"lr", "weight_decay", "max_grad_norm", "bf16"}, section
    for section in (TrainConfig, SFTConfig, DPOConfig, KTOConfig, GroundPhase):
        assert typing.get_type_hints(section)["optimizer"] is OptimizerConfig
    with pytest.raises(ConfigError) as err:
        parse_params({"dpo": {"lr": 1e-6}}, file="old.yaml")
    assert str(err.value).startswith(
        "unknown key 'lr' in section 'dpo' (set by params file old.yaml); it now lives in 'dpo.optimizer.lr';"
    )


@pytest.fixture
def project(tmp_path):
    """A params file (line numbers below matter), a presets folder beside it, suite files for the paths."""
    (tmp_path / "params.yaml").write_text(
        "# comment\n"
        "train:\n"
        "  optimizer: {lr: 1.0e-05}\n"  # line 3
        "  epochs: 2\n"  # line 4
        "  loss:\n"
        "    clip_low: 0.2\n"  # line 6
        "ground:\n"
        "  phases:\n"  # line 8
        "    - {steps: 5}\n"  # line 9
    )
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "bad-lr.yaml").write_text("# a bad preset\ntrain:\n  optimizer:\n    lr: -1\n")
    (tmp_path / "presets" / "typo.yaml").write_text("train:\n  loss:\n    clip_lwo: 0.1\n")
    (tmp_path / "presets" / "phase.yaml").write_text(
        "ground:\n  phases:\n    - {steps: 3}\n    - {steps: 0}\n"
    )
    return tmp_path


def test_value_from_params_file_names_file_and_line(project):
    (project / "params.yaml").write_text((project / "params.yaml").read_text().replace("0.2", "1.5"))
    with pytest.raises(ConfigError) as err:
        load_params(project / "params.yaml")
    assert str(err.value) == (
        f"train.loss.clip_low = 1.5 is out of range: must be < 1 (set by params file {project / 'params.yaml'}:6)"
    )


def test_value_from_preset_names_preset_and_line(project):
    preset = re.escape(str(project / "presets" / "bad-lr.yaml"))
    with pytest.raises(
        ConfigError,
        match=rf"train\.optimizer\.lr = -1 is out of range: must be > 0 \(set by preset {preset}:4\)$",
    ):
        load_params(project / "params.yaml", preset="bad-lr")


def test_override_wins_and_is_named(project):
    p = load_params(
        project / "params.yaml", ["train.optimizer.lr=0.5"], preset="bad-lr"
    )  # override over preset
    assert p.train.optimizer.lr == 0.5
    with pytest.raises(ConfigError) as err:
        load_params(project / "params.yaml", ["train.optimizer.lr=-2"])
    assert str(err.value).endswith("(set by command-line override -S train.optimizer.lr=-2)")


def test_type_error_from_an_override_names_the_override_not_the_file(project):
    with pytest.raises(ConfigError) as err:
        load_params(project / "params.yaml", ["train.optimizer.lr=abc"])
    assert (
        str(err.value)
        == "train.optimizer.lr = 'abc' is not a number (set by command-line override -S train.optimizer.lr=abc)"
    )


def test_unknown_keys_name_their_source(project):
    with pytest.raises(
        ConfigError, match=r"unknown key 'clip_lwo' in section 'train\.loss' \(set by preset .*typo\.yaml:3\)"
    ):
        load_params(project / "params.yaml", preset="typo")
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'epochz' in section 'train' \(set by command-line override -S train\.epochz=3\)",
    ):
        load_params(project / "params.yaml", ["train.epochz=3"])
    with pytest.raises(
        ConfigError, match=r"unknown key 'trian' in the top level \(set by command-line override"
    ):
        load_params(project / "params.yaml", ["trian.lr=3"])
    (project / "params.yaml").write_text("train:\n  epochs: 1\n  epochz: 3\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'epochz' in section 'train' \(set by params file .*params\.yaml:3\)"
    ):
        load_params(project / "params.yaml")


def test_a_list_replaced_by_a_preset_is_the_presets_down_to_its_items(project):
    needle = r"ground\.phases\[1\]\.steps = 0 is out of range: must be >= 1 \(set by preset .*phase\.yaml:4\)"
    with pytest.raises(ConfigError, match=needle):
        load_params(project / "params.yaml", preset="phase")


def test_provenance_of_keys_no_source_wrote():
    """A list accounts for its items' keys (a phase's omitted key comes with the phase); a section's
    omitted key is the default's."""
    prov = Provenance()
    prov.replace(
        ("ground",), {"phases": [{"steps": 5}]}, lambda path: Source("params file", f"p.yaml:{len(path)}")
    )
    prov.replace(("train",), {"lr": 0.1}, lambda path: Source("preset", "q.yaml"))
    assert str(prov.source(("ground", "phases", 0, "lr"))) == "params file p.yaml:2"
    assert str(prov.source(("ground", "phases", 0, "steps"))) == "params file p.yaml:4"
    assert prov.source(("ground", "eval_levels")) is None
    assert prov.source(("train", "epochs")) is None
    prov.replace(
        ("ground", "phases"), [], lambda path: Source("command-line override", "-S ground.phases=[]")
    )
    assert str(prov.source(("ground", "phases", 0, "steps"))) == "command-line override -S ground.phases=[]"


def test_cross_field_message_names_both_sources(project):
    (project / "presets" / "mini.yaml").write_text("train:\n  mini_batch_size: 2\n")
    with pytest.raises(ConfigError) as err:
        load_params(project / "params.yaml", ["train.micro_batch_size=3"], preset="mini")
    assert str(err.value) == (
        "train.micro_batch_size = 3 is out of range: must be <= mini_batch_size (set by command-line "
        f"override -S train.micro_batch_size=3; train.mini_batch_size = 2 set by preset "
        f"{project / 'presets' / 'mini.yaml'}:2)"
    )
    with pytest.raises(ConfigError, match=r"\(default value; train\.mini_batch_size = 2 set by preset"):
        load_params(
            project / "params.yaml", preset="mini"
        )  # micro_batch_size 4 is nobody's but the default's


def test_a_mapping_given_in_an_override_replaces_the_section(project):
    p = load_params(project / "params.yaml", ["train.loss={clip_low: 0.1}"])
    assert p.train.loss.clip_low == 0.1 and p.train.loss.clip_high == 0.3  # the others: defaults
    with pytest.raises(
        ConfigError,
        match=r"train\.loss\.clip_high = 0 .*\(set by command-line override -S train\.loss=\{clip_high: 0\}\)",
    ):
        load_params(project / "params.yaml", ["train.loss={clip_high: 0}"])


# --------------------------------------------------------------------------------------------------
# Files: empty, YAML errors, duplicate keys, presets, paths


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# and another\n", "{}\n", "---\n"])
def test_an_empty_params_file_is_an_error_naming_it(tmp_path, text):
    f = tmp_path / "params.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}: the params file is empty"):
        load_params(f)


def test_an_empty_preset_is_an_error_naming_it(project):
    (project / "presets" / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: the preset is empty"):
        load_params(project / "params.yaml", preset="empty")


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  lr: 0.1\n   epochs: 2\n")
    with pytest.raises(ConfigError) as err:
        load_params(f)
    msg = str(err.value)
    assert msg.startswith(f"{f}:3:10: YAML syntax error: mapping values are not allowed here"), msg
    assert "\n" not in msg


def test_a_bad_yaml_override_names_the_override():
    with pytest.raises(
        ConfigError, match=r"^command-line override -S train\.optimizer\.lr=\[1: the value is not valid YAML"
    ):
        load_params(ROOT / "params.yaml", ["train.optimizer.lr=[1"])


def test_a_key_written_twice_is_an_error(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  lr: 0.1\ntrain:\n  epochs: 2\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(f))}:3: duplicate key train \(first at line 1\)"
    ):
        load_params(f)


def test_unknown_preset_lists_the_available_ones(project):
    with pytest.raises(ConfigError) as err:
        load_params(project / "params.yaml", preset="quik")
    assert str(err.value) == (
        f"unknown preset 'quik'; available presets ({project / 'presets' / '*.yaml'}): bad-lr, phase, typo"
    )
    with pytest.raises(ConfigError, match=r"unknown preset 'quik'; available presets .*: .*grpo.*quick"):
        load_params(ROOT / "params.yaml", preset="quik")
    with pytest.raises(ConfigError, match=r"preset not found: .*nope\.yaml"):
        load_params(ROOT / "params.yaml", preset=ROOT / "presets" / "nope.yaml")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "env.in_domain_suite=data/suites/nope.yaml",
            r"env\.in_domain_suite = 'data/suites/nope\.yaml' does not exist",
        ),
        ("env.out_of_domain_suite=data/suites", r"env\.out_of_domain_suite = 'data/suites' does not exist"),
        (
            "ground.checkpoint=assets",
            r"ground\.checkpoint = 'assets' is not a checkpoint: must be a directory holding config\.json",
        ),
        ("init_policy.pretrained=/nowhere", r"init_policy\.pretrained = '/nowhere' is not a checkpoint"),
    ],
)
def test_paths_must_exist_when_params_load(override, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_params(ROOT / "params.yaml", [override])
    assert str(err.value).endswith(f"(set by command-line override -S {override})")
    key, value = override.split("=")
    assert _get(parse_params(_raw(key, value)), key) == value  # parse_params alone does not look at files


def test_existing_paths_and_null_checkpoints_load(tmp_path, monkeypatch):
    p = load_params(
        ROOT / "params.yaml",
        ["init_policy.pretrained=assets/checkpoints/grounded-xs", "ground.checkpoint=null"],
    )
    assert p.init_policy.pretrained == "assets/checkpoints/grounded-xs" and p.ground.checkpoint is None
    monkeypatch.chdir(tmp_path)  # relative paths are read from the working directory
    with pytest.raises(ConfigError, match=r"relative paths are read from the working directory"):
        load_params(ROOT / "params.yaml")
    suite, checkpoint = ROOT / "data/suites/miniwob_quick.yaml", ROOT / "assets/checkpoints/grounded-xs"
    absolute = [
        f"env.in_domain_suite={suite}",
        f"env.out_of_domain_suite={suite}",
        f"ground.checkpoint={checkpoint}",
    ]
    assert load_params(ROOT / "params.yaml", absolute).env.in_domain_suite == str(suite)


# --------------------------------------------------------------------------------------------------
# Overrides


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
    with pytest.raises(ConfigError, match="'checkpoint' is not a section"):
        load_params(f, ["ground.checkpoint=null", "ground.checkpoint.x=1"])


def test_an_override_names_a_list_item_by_its_index():
    root = ROOT / "params.yaml"
    p = load_params(
        root, ["ground.phases.1.seed=22", "ground.phases.0.mix.box4=2"], preset="ground-reading-2l"
    )
    control = load_params(root, preset="ground-reading-2l").ground.phases
    assert [ph.seed for ph in p.ground.phases] == [11, 22, 13] and p.ground.phases[0].mix["box4"] == 2
    assert p.ground.phases[2] == control[2] and p.ground.phases[1].mix == control[1].mix
    with pytest.raises(ConfigError, match=r"'ground.phases' is a list of 3, so '3' must be an index 0..2"):
        load_params(root, ["ground.phases.3.seed=1"], preset="ground-reading-2l")
    with pytest.raises(
        ConfigError, match=r"ground.phases\[0\].seed = -1 is out of range.*-S ground.phases.0.seed=-1"
    ):
        load_params(root, ["ground.phases.0.seed=-1"], preset="ground-reading-2l")


def test_overrides_and_merge_do_not_mutate_input():
    raw = {"train": {"epochs": 1, "loss": {"clip_low": 0.1}}, "ground": {"phases": [{"steps": 1}]}}
    apply_overrides(raw, ["train.epochs=5", "train.loss.clip_low=0.3"])
    merged = merge(raw, {"train": {"loss": {"clip_high": 0.5}}})
    merged["ground"]["phases"][0]["steps"] = 9
    assert raw == {"train": {"epochs": 1, "loss": {"clip_low": 0.1}}, "ground": {"phases": [{"steps": 1}]}}
    assert merged["train"] == {"epochs": 1, "loss": {"clip_low": 0.1, "clip_high": 0.5}}


# --------------------------------------------------------------------------------------------------
# Construction in code


def test_sections_that_validate_on_construction_use_the_declared_rules():
    with pytest.raises(
        ConfigError, match=r"ReplayConfig\.capacity_per_task = 0 is out of range: must be >= 1$"
    ):
        ReplayConfig(capacity_per_task=0)
    with pytest.raises(
        ValueError, match=r"SelectConfig\.max_success_rate = 1\.5 is out of range: must be <= 1"
    ):
        SelectConfig(max_success_rate=1.5)
    with pytest.raises(ValueError, match=r"GroundPhase\.mix = \{\} is too short: must have at least 1 item$"):
        GroundPhase(mix={})
    assert SelectConfig(max_tasks=3).max_tasks == 3


def test_other_sections_are_built_freely_in_code():
    """Cross-field rules and the other sections' ranges are the loader's: code (tests) builds partial
    configs, e.g. a micro-batch larger than a tiny test's mini-batch."""
    assert TrainConfig(micro_batch_size=8, mini_batch_size=2).micro_batch_size == 8


def test_an_unsupported_rule_is_a_programming_error():
    @dataclass(frozen=True)
    class Odd:
        n: Annotated[int, at.MultipleOf(2)] = 2

    with pytest.raises(TypeError, match="unsupported range rule MultipleOf"):
        check_fields(Odd())


# --------------------------------------------------------------------------------------------------
# Documentation


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


# --------------------------------------------------------------------------------------------------
# policy.backend (issue 16, item 5)


def test_vllm_backend_params_are_valid_with_either_engine():
    for engine in ("torch", "deepspeed"):
        p = load_params(ROOT / "params.yaml", ["policy.backend=vllm", f"train.engine={engine}"])
        assert p.policy.backend == "vllm" and p.train.engine == engine
    assert load_params(ROOT / "params.yaml", ["policy.backend=vllm"]).policy.backend == "vllm"
    assert load_params(ROOT / "params.yaml").policy.backend == "hf"  # the embedded default


def test_vllm_max_model_len_must_leave_room_for_a_prompt():
    with pytest.raises(ConfigError) as err:
        load_params(
            ROOT / "params.yaml",
            ["policy.backend=vllm", "policy.max_new_tokens=512", "policy.vllm.max_model_len=256"],
        )
    msg = str(err.value)
    assert msg.startswith(
        "policy.vllm.max_model_len = 256 is out of range: must be > max_new_tokens = 512"
    ), msg
    assert "-S policy.vllm.max_model_len=256" in msg and "policy.backend = 'vllm'" in msg, msg
    # the rule is about the vllm backend only
    parse_params({"policy": {"max_new_tokens": 512, "vllm": {"max_model_len": 256}}})


def test_params_yaml_holds_exactly_the_dataclass_defaults():
    """Issue 30 item 3, each value said once: the defaults of the config dataclasses are the values the
    main job (`make run`, params.yaml) uses, so a config built in code and the pipeline agree; a key
    changed in one place and not the other fails here, naming it."""
    from arpo_core.config import to_dict

    written = yaml.safe_load((ROOT / "params.yaml").read_text())
    defaults = to_dict(parse_params({}))

    def diff(a, b, prefix=""):
        out = {}
        for k in sorted(set(a) | set(b)):
            key = f"{prefix}{k}"
            if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
                out |= diff(a[k], b[k], key + ".")
            elif a.get(k, "<absent>") != b.get(k, "<absent>"):
                out[key] = (a.get(k, "<absent>"), b.get(k, "<absent>"))
        return out

    assert diff(written, defaults) == {}, "params.yaml (left) and the dataclass defaults (right) differ"


def test_the_click_readouts_are_the_heads_readouts():
    """`policy.click_readout` offers `tokens` and exactly the readouts policy/heads.py implements (the
    config cannot import torch, so the Literal restates them; this ties the two)."""
    from arpo_core.config import PolicyConfig
    from arpo_core.policy.heads import READOUTS

    hints = typing.get_type_hints(PolicyConfig, include_extras=True)
    assert typing.get_args(hints["click_readout"]) == ("tokens", *READOUTS)
