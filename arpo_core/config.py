"""Frozen dataclasses for `params.yaml`, one per section, and a strict loader.

Decisions:
1. `params.yaml` is the single source of truth (DVC reads the same file). Each top-level section parses
   into one frozen dataclass named after it (`train:` -> `TrainConfig`), following the 1:1:1 rule of
   docs/design.md: a DVC stage = a Prefect flow = an MLflow run = a params section.
2. Unknown keys are errors, never ignored: a typo such as `train.replay.enabeld` would otherwise silently
   run the default. The message names the key, the section path and the file.
3. Values are type-checked against the annotations (bool is not accepted for int, an int is accepted
   for float); nested sections are nested dataclasses (`train.replay`).
4. Overrides use DVC's dotted syntax (`train.replay.enabled=false`, values parsed as YAML) so that
   `dvc exp run -S`, the CLI and Prefect deployment parameters mean the same thing.
5. Every field has a default equal to the embedded default pipeline, so a partial params file is valid;
   `params.yaml` in the repo lists every key anyway, for discoverability.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from arpo_core.offline_config import DPOConfig, GroundTrainConfig, KTOConfig, RFTConfig, SFTConfig
from arpo_core.replay import ReplayConfig
from arpo_core.selection import SelectConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A params file that does not match the config dataclasses; the message names key and file."""


# --------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class ProjectConfig:
    name: str = "arpo-embedded"
    """MLflow experiment name and prefix of run names."""
    seed: int = 0
    """Global seed: env episodes, sampling, replay draws and selection are derived from it."""
    torch_threads: int = 1
    """torch intra-op threads per process. On 2 cores shared with browsers, more threads spin and made
    CPU training ~10x slower (measured); raise it on machines with cores to spare."""


@dataclass(frozen=True)
class EnvConfig:
    backend: Literal["process", "ray"] = "process"
    """Env workers as local processes, or owned by Ray actors (placeable across machines)."""
    n_envs: int = 8
    """Parallel envs (reference: tasks per iteration x group size = 128)."""
    in_domain_suite: str = "data/suites/miniwob_in_domain.yaml"
    """Tasks trained on (and their demos)."""
    out_of_domain_suite: str = "data/suites/miniwob_out_of_domain.yaml"
    """Held-out tasks for generalisation."""
    episode_time_limit_s: float | None = 60.0
    """MiniWoB episode clock (its own default of 10 s fails slow CPU policies); null: no limit."""
    reset_timeout_s: float = 120.0
    """Limit for one reset (browser start included)."""
    step_timeout_s: float = 60.0
    """Limit for one step."""
    eval_timeout_s: float = 60.0
    """Limit for one evaluation."""
    reset_retries: int = 8
    """Reset attempts before an env is reported failed (reference: 8)."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per env actor, e.g. {env_node: 0.01} (backend ray)."""


@dataclass(frozen=True)
class PolicyConfig:
    system_prompt: Literal["uitars", "compact"] = "compact"
    """Prompt template: the full UI-TARS computer-use prompt, or a short one for tiny CPU models."""
    history_images: int | None = None
    """Screenshots shown as images (older turns keep their text); null: all, which keeps the
    trainer's recomputed log-probs exactly equal to the generator's."""
    max_new_tokens: int = 64
    """Reply length limit in tokens."""
    coord_mode: Literal["absolute", "relative1000"] = "absolute"
    """Model coordinates: pixels of the smart_resized image (UI-TARS-1.5) or 0-1000 (UI-TARS-1.0)."""


@dataclass(frozen=True)
class InitPolicyConfig:
    size: Literal["xs", "s", "m"] = "xs"
    """Tiny architecture built offline (xs 0.7M, s 5.1M, m 36.5M parameters)."""
    seed: int = 0
    """Tokenizer corpus and weight initialisation."""
    pretrained: str | None = None
    """Path of an existing Qwen2.5-VL checkpoint (e.g. UI-TARS-1.5-7B): used instead of building one."""
    rope_theta: float = 5.0
    """Base of the tiny LM's rotary positions. At Qwen's 1e6 a tiny head's M-RoPE h/w bands barely turn
    across the visual tokens and clicks stay image-blind; 5 made them follow the target
    (benchmarks/results/grounding.md)."""
    mrope: list[int] | None = field(default_factory=lambda: [2, 7, 7])
    """(t, h, w) split of head_dim/2 rotary frequencies; null: Qwen's proportions (xs [4,6,6], s [8,12,12]).
    [2,7,7] (xs) is the architecture of the grounding recipe and of `ground.checkpoint`."""


@dataclass(frozen=True)
class GroundPhase(GroundTrainConfig):
    """One phase of grounding pretraining (`ground.phases[i]`): the training fields of
    `GroundTrainConfig` (shared with `arpo_core.grounding.GroundConfig`), plus `miniwob_seeds` and
    `grow_after`, which the stage applies around the training loop."""

    miniwob_seeds: int = 0
    """Real MiniWoB screens of the in-domain suite's tasks with env seeds 0..N-1 as a fixed example
    list (half of every batch); 0 = synthetic screens only."""
    grow_after: list[int] | None = None
    """Before this phase, insert a zero-output decoder layer after each listed layer index
    (`policy.model.grow_depth`); null = keep the depth."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(
                f"ground phase steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}"
            )
        if self.miniwob_seeds < 0:
            raise ValueError(f"ground phase miniwob_seeds must be >= 0, got {self.miniwob_seeds}")
        if not self.mix or any(not w > 0 for w in self.mix.values()):
            raise ValueError(f"ground phase mix needs at least one level, weights > 0, got {self.mix}")


@dataclass(frozen=True)
class GroundSectionConfig:
    """Grounding pretraining (stage `ground`): where the grounded policy comes from and how it is measured.
    (Not named `GroundConfig`: that is `arpo_core.grounding`'s training-loop config, one per phase.)"""

    checkpoint: str | None = "assets/checkpoints/grounded-xs"
    """Start from this checkpoint directory (the project's versioned grounded tiny policy) instead of
    `models/init`; null = start from `models/init` and train with `phases`. A pretrained model named by
    `init_policy.pretrained` wins over it (this is a tiny model)."""
    phases: list[GroundPhase] = field(default_factory=list)
    """Training phases run in order on the starting policy; empty = use the start as it is."""
    eval_levels: list[str] = field(default_factory=lambda: ["box1h", "box4", "widget1", "widget4"])
    """Held-out synthetic levels measured after training (one measure set per level)."""
    eval_per_level: int = 64
    """Held-out synthetic screens per level (>= 2: correlations need two points)."""
    eval_miniwob_seeds: int = 3
    """Held-out real MiniWoB screens: the in-domain suite's tasks with env seeds 1000..1000+N-1;
    0 = none (no browser)."""
    miniwob_per_screen: int = 4
    """At most this many targets per real MiniWoB screen (training and held-out)."""

    def __post_init__(self) -> None:
        if self.eval_levels and self.eval_per_level < 2:
            raise ValueError(f"ground eval_per_level must be >= 2, got {self.eval_per_level}")
        if self.eval_miniwob_seeds < 0 or self.miniwob_per_screen < 1:
            raise ValueError("ground eval_miniwob_seeds must be >= 0 and miniwob_per_screen >= 1")


@dataclass(frozen=True)
class DemosConfig:
    episodes_per_task: int = 60
    """Oracle episodes per in-domain task (seeded, distinct instances)."""
    seed: int = 100000
    """First env seed of the demos (kept apart from evaluation seeds)."""


@dataclass(frozen=True)
class BaselineConfig:
    episodes_per_task: int = 16
    """Base-policy rollouts per task for task selection (paper: 16)."""
    temperature: float = 1.0
    """Sampling temperature of those rollouts."""
    max_steps: int = 15
    """Episode step limit."""
    seed: int = 200000
    """First env seed."""


@dataclass(frozen=True)
class EvaluateConfig:
    episodes_per_task: int = 50
    """Episodes per task and split (>= 50 to see a 10-point change, docs/method.md §7)."""
    temperature: float = 0.0
    """0: greedy. The paper evaluates with 0.5-0.6; `sampled_temperature` adds that mode."""
    sampled_temperature: float | None = None
    """Also evaluate sampled at this temperature (null: greedy only)."""
    max_steps: int = 15
    """Episode step limit."""
    seed: int = 900000
    """First env seed (disjoint from demos, baseline and training seeds)."""
    osworld_hard: bool = False
    """Score with the OSWorld-Hard rule (step limit + FAIL scores 0)."""


@dataclass(frozen=True)
class LossSection:
    clip_low: float = 0.2
    """PPO clip below: ratio >= 1 - clip_low."""
    clip_high: float = 0.3
    """PPO clip above (asymmetric, 'clip-higher'): ratio <= 1 + clip_high."""
    clip_dual: float | None = 3.0
    """Dual-clip constant c (> 1) for negative advantages; null switches the dual clip off."""
    kl_coef: float = 0.0
    """KL penalty to the reference policy; ARPO uses 0 (no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator when kl_coef > 0."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are reduced (verl's agg_loss modes)."""
    sum_norm: float | None = None
    """Fixed divisor for seq-mean-token-sum-norm (null: the padded length, as verl)."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Std used to normalise group-relative advantages: per group, whole batch, or none (Dr. GRPO)."""
    advantage_eps: float = 1e-6
    """Added to the std before dividing (verl 1e-6; TRL 1e-4)."""
    format_penalty: float = -1.0
    """Reward of an unparseable reply (paper -1; reference code -0.5)."""


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    """Passes over the selected task set."""
    tasks_per_iteration: int = 4
    """Tasks per rollout batch (reference: 16)."""
    group_size: int = 8
    """Rollouts per task, G (reference: 8)."""
    lr: float = 1e-5
    """AdamW learning rate (reference 1e-6 for a 7B model; the tiny policy needs more)."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient norm clip."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward."""
    mini_batch_size: int = 32
    """Trajectories per optimizer step (reference: 64, i.e. 2 steps per 128-trajectory iteration)."""
    ppo_epochs: int = 1
    """Optimisation passes over each rollout batch."""
    temperature: float = 1.0
    """Sampling temperature during training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling during training rollouts."""
    max_steps: int = 15
    """Episode step limit."""
    use_selection: bool = True
    """Train on the selected tasks (true) or on the whole in-domain suite (false)."""
    engine: Literal["torch", "deepspeed"] = "torch"
    """Training engine."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (engine deepspeed)."""
    skip_zero_advantage: bool = False
    """Leave sequences with advantage exactly 0 out of the update (compute saving; the reference keeps
    them, which also dilutes the token-mean)."""
    bf16: bool = False
    """bf16 autocast (CPU or GPU)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    loss: LossSection = field(default_factory=LossSection)


@dataclass(frozen=True)
class Params:
    """The whole params file: shared sections (project, env, policy), then one per pipeline stage in
    order. Sections whose semantics live in one module are defined there (`ReplayConfig` in replay.py,
    `SelectConfig` in selection.py, `SFTConfig`/`RFTConfig`/`DPOConfig`/`KTOConfig` (behaviour cloning
    and the offline baselines) in offline_config.py)."""

    project: ProjectConfig = field(default_factory=ProjectConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    init_policy: InitPolicyConfig = field(default_factory=InitPolicyConfig)
    ground: GroundSectionConfig = field(default_factory=GroundSectionConfig)
    demos: DemosConfig = field(default_factory=DemosConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    rft: RFTConfig = field(default_factory=RFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)


# --------------------------------------------------------------------------------------------------
# Loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str, file: str) -> Any:
    """Check `value` against annotation `tp`, converting nested mappings into dataclasses."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{file}: '{where}' must be a mapping (section), got {value!r}")
        return _build(tp, value, where, file)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where, file)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{file}: '{where}' = {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{file}: '{where}' = {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{file}: '{where}' must be a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{where}[{i}]", file) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{file}: '{where}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{file}: '{where}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{file}: '{where}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{file}: '{where}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{file}: '{where}' must be a string, got {value!r}")
        return value
    raise ConfigError(f"{file}: '{where}': unsupported annotation {tp!r}")


def _build(cls: type[T], raw: Mapping[str, Any], where: str, file: str) -> T:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            section = f"section '{where}'" if where else "the top level"
            raise ConfigError(
                f"{file}: unknown key '{key}' in {section} (known keys: {', '.join(sorted(known))})"
            )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k, file) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # a section's own __post_init__ checks (ranges, combinations)
        raise ConfigError(f"{file}: section '{where or '<top>'}': {e}") from e


def parse_params(raw: Mapping[str, Any] | None, file: str = "<params>") -> Params:
    """Validate a parsed params mapping into `Params`."""
    return _build(Params, raw or {}, "", file)


def apply_overrides(raw: Mapping[str, Any] | None, overrides: Sequence[str]) -> dict[str, Any]:
    """Apply DVC-style `a.b.c=value` overrides (values parsed as YAML) to a raw params mapping."""
    out: dict[str, Any] = _deepcopy(raw or {})
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = out
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{k}' is not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(text)
    return out


def _deepcopy(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, Mapping) else v for k, v in m.items()}


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"params file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return dict(raw)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: sections merge key by key, leaves of `over` win."""
    out = _deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = _deepcopy(v) if isinstance(v, Mapping) else v
    return out


def load_params(
    path: str | Path = "params.yaml", overrides: Sequence[str] = (), preset: str | Path | None = None
) -> Params:
    """Read a params file, merge a preset file over it (a partial params file, e.g. presets/quick.yaml),
    apply dotted overrides, validate. Unknown keys raise ConfigError naming the file they came from."""
    path = Path(path)
    raw = _read_yaml(path)
    where = str(path)
    if preset is not None:
        preset_path = Path(preset)
        if not preset_path.exists() and not preset_path.suffix:
            preset_path = path.parent / "presets" / f"{preset}.yaml"
        over = _read_yaml(preset_path)
        parse_params(merge({}, over), file=str(preset_path))  # a typo in the preset names the preset
        raw = merge(raw, over)
        where = f"{path} + {preset_path}"
    return parse_params(apply_overrides(raw, overrides), file=where)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as plain nested dicts (for MLflow params and JSON)."""
    return dataclasses.asdict(cfg)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'replay': {'enabled': True}}} -> {'train.replay.enabled': True}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
