"""Frozen dataclasses for `params.yaml`, one per section, and a strict loader.

Decisions:
- **Single params file.** `params.yaml` is the single source of truth (DVC reads the same file). Each
  top-level section parses into one frozen dataclass named after it (`train:` -> `TrainConfig`), following the
  1:1:1 rule of docs/design.md: a DVC stage = a Prefect flow = an MLflow run = a params section.
- **Unknown keys rejected.** Unknown keys are errors, never ignored: a typo such as `train.replay.enabeld`
  would otherwise silently run the default. The message names the key, the section path and where the key was
  written.
- **Type-checked values.** Values are type-checked against the annotations (bool is not accepted for int, an
  int is accepted for float, floats must be finite); nested sections are nested dataclasses (`train.replay`).
- **Dotted overrides.** Overrides use DVC's dotted syntax (`train.replay.enabled=false`, values parsed as
  YAML) so that `dvc exp run -S`, the CLI and Prefect deployment parameters mean the same thing; a list
  item is named by its index (`ground.phases.0.seed=21`: one phase's seed, the rest of the list as set).
- **One default per field.** Every field has exactly one default, its dataclass default, equal to the embedded
  default pipeline, so a partial params file is valid; `params.yaml` in the repo lists every key anyway, for
  discoverability (its values win where they differ). An empty params file is an error, not the
  defaults: it is more likely a truncated file than a wish.
- **Declared ranges.** Ranges are declared on the field they constrain, as annotated_types metadata
  (`lr: Annotated[float, Gt(0)]`, `clip_dual: Annotated[float, Gt(1)] | None`), and checked when params
  load, after type coercion (config/check.py), so a bad value fails at once, not hours later in a stage.
  Path fields that must exist carry `ExistingPath`: `load_params` checks them (relative paths from the
  working directory, where the stages open them); `parse_params` alone does not check them (only
  `env`'s cross-check reads the kind of suite files that exist).
  Rules across fields are a section's `cross_checks()` method, run by the loader.
- **Unchecked construction.** Construction in code is not range-checked (callers such as tests build configs
  freely), except the sections that always validated themselves (`ReplayConfig`, `SelectConfig`,
  `GroundPhase`, `GroundSectionConfig`), whose `__post_init__` calls `check_fields`: the same declared rules.
- **Provenance.** Provenance: `load_params` records, for every key, which source last set it (params file <
  preset < override, with the line in the file), and every error names it:
  `train.loss.clip_low = 1.5 is out of range: must be < 1 (set by command-line override -S
  train.loss.clip_low=1.5)`. A YAML syntax error names file:line:column; a key written twice in one
  mapping is an error (YAML would keep the last silently); an unknown preset lists the presets.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from annotated_types import Ge, Gt, Interval, Le, Len, MinLen

from arpo_core.config.check import (
    ConfigError,
    Context,
    CrossChecks,
    ExistingPath,
    KeyPath,
    Provenance,
    Source,
    build,
    check_fields,
    dotted,
    unknown_suite_task,
)
from arpo_core.config.sections import (
    TRAINED_HEADS,
    DPOConfig,
    GroundTrainConfig,
    KTOConfig,
    OptimizerConfig,
    ReplayConfig,
    RFTConfig,
    SelectConfig,
    SFTConfig,
)
from arpo_core.config.suites import SuiteError, suite_problem

__all__ = [
    "BaselineConfig",
    "ConfigError",
    "DemosConfig",
    "EnvConfig",
    "EvaluateConfig",
    "ExistingPath",
    "GroundPhase",
    "GroundSectionConfig",
    "InitPolicyConfig",
    "LossSection",
    "OSWorldConfig",
    "OptimizerConfig",
    "Params",
    "PolicyConfig",
    "ProjectConfig",
    "TrainConfig",
    "VLLMConfig",
    "apply_overrides",
    "flatten",
    "load_params",
    "merge",
    "parse_params",
    "suite_backends",
    "to_dict",
]

# --------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class ProjectConfig:
    name: Annotated[str, MinLen(1)] = "arpo-embedded"
    """MLflow experiment name and prefix of run names."""
    seed: Annotated[int, Ge(0)] = 0
    """Global seed: env episodes, sampling, replay draws and selection are derived from it."""
    success_threshold: Annotated[float, Interval(ge=0, lt=1)] = 0.1
    """What a success is, everywhere: an episode whose checker score (in [0, 1]; OSWorld can score
    fractions) is strictly greater than this. The replay buffer stores such episodes, task selection
    counts them, RFT keeps them, DPO and KTO take them as chosen / desirable (reference: > 0.1). One key:
    the five stages that used to hold a copy each could disagree."""
    torch_threads: Annotated[int, Ge(1)] = 1
    """torch intra-op threads per process. On 2 cores shared with browsers, more threads spin and made
    CPU training ~10x slower (measured); raise it on machines with cores to spare."""


@dataclass(frozen=True)
class OSWorldConfig:
    """OSWorld desktops (`env.kind: osworld`; read by `pipeline/rollouts.py`, docs/osworld.md): which
    provider runs them and the `OSWorldEnv` settings (the same names as its arguments)."""

    provider: Literal["local", "remote", "desktop_env"] = "local"
    """local: the project's own Xvfb desktop, a fresh one per reset; remote: running OSWorld VM servers
    (`base_urls`; no snapshot revert); desktop_env: the official desktop-env package through the bridge."""
    base_urls: list[Annotated[str, MinLen(1)]] = field(default_factory=list)
    """remote: base URLs of servers speaking OSWorld's HTTP protocol (e.g. the official image's port 5000),
    one env per URL; each is health-checked (GET /platform) before a pool starts."""
    token: str | None = None
    """remote: Bearer token sent to the servers (OSWorld's own servers want none: null)."""
    claim_dir: str | None = None
    """remote: folder of the URL claims, one lock file per URL (null: ~/.cache/arpo/osworld-claims/<hash>)."""
    health_timeout_s: Annotated[float, Gt(0)] = 5.0
    """remote: how long each URL may take to answer the health check."""
    screen_width: Annotated[int, Ge(64)] = 1024
    """local: desktop width in pixels. 1024x640 is the smallest 16:10 screen that holds the desktop's
    100x30 terminal whole (905x597 px); the tiny policy's pixel budget shrinks any larger screen to the
    same 560x336 model image, so more pixels would only cost screenshot time and Parquet bytes on a CPU."""
    screen_height: Annotated[int, Ge(64)] = 640
    """local: desktop height in pixels (see screen_width). Remote desktops report their own size."""
    settle_s: Annotated[float, Ge(0)] = 0.5
    """Pause after a step's actions before the screenshot (the UI catches up); desktop_env: the official
    `DesktopEnv.step` pause."""
    setup_settle_s: Annotated[float, Ge(0)] = 1.0
    """Pause after a task's setup steps before the first screenshot."""
    wait_s: Annotated[float, Ge(0)] = 2.0
    """How long the `wait()` action sleeps (OSWorld's WAIT)."""
    command_timeout_s: Annotated[float, Gt(0)] = 60.0
    """local: limit for one command run on the desktop."""
    download_cache_dir: str | None = None
    """Cache of setup `download` files under OSWorld's cache names; a filled one runs them offline (null:
    ~/.cache/arpo/osworld-downloads)."""
    desktop_env_python: str | None = None
    """desktop_env: the interpreter of the desktop-env venv (null: scripts/setup_desktop_env.sh's)."""
    desktop_env_args: list[str] = field(default_factory=lambda: ["--provider-name", "docker"])
    """desktop_env: arguments of the bridge's `serve` (official provider, VM path, screen, ...)."""
    desktop_env_timeout_s: Annotated[float, Gt(0)] = 600.0
    """desktop_env: limit for starting the bridge and for each of its calls (VMs boot and revert slowly)."""


def checkpoint_model_type(path: str | Path) -> str | None:
    """config.json's `model_type` of a checkpoint directory, or None when it cannot be read here (a
    missing path is reported by its own check)."""
    import json

    try:
        return str(json.loads((Path(path) / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return None


def suite_backends(path: str | Path) -> set[str] | None:
    """The backends of a suite file's tasks (its `backend`, default miniwob, and any task's own), or None
    when the file cannot be read here (a missing path is reported by its own check)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    top = str(doc.get("backend", "miniwob"))
    tasks = doc.get("tasks") if isinstance(doc.get("tasks"), list) else []
    return {top} | {str(t["backend"]) for t in tasks if isinstance(t, dict) and "backend" in t}


@dataclass(frozen=True)
class RolloutModeConfig:
    """How episodes interleave with generation inside one rollout call (arpo_core/algorithm/rollout.py,
    decision "Sync and async schedules"). Speed only: the episodes are the same in either mode (seeds per job
    and step), so the stage table leaves these keys out, like the env count."""

    mode: Literal["sync", "async"] = "async"
    """sync: step-synchronous rounds (every live episode in one batch, then every env steps, the reference's
    loop); async: an env steps as soon as its reply is ready and the generator batches the prompts that
    are ready. Measured: benchmarks/results/rollout.json, rollout_sim.json."""
    batch_wait_s: Annotated[float, Ge(0), Le(60)] = 0.0
    """async: how long the oldest ready prompt may wait for other envs' prompts to join its batch."""


@dataclass(frozen=True)
class EnvConfig:
    kind: Literal["miniwob", "osworld"] = "miniwob"
    """Which envs the stages play: MiniWoB++ pages in headless Chromium (the embedded default) or OSWorld
    desktops (`osworld`); the suites must be of the same kind."""
    backend: Literal["process", "ray"] = "process"
    """Env workers as local processes, or owned by Ray actors (placeable across machines)."""
    n_envs: Annotated[int, Ge(1)] = 8
    """Parallel envs (reference: tasks per iteration x group size = 128)."""
    in_domain_suite: Annotated[str, ExistingPath()] = "data/suites/miniwob_instances_main.yaml"
    """Tasks trained on (and their demos)."""
    out_of_domain_suite: Annotated[str, ExistingPath()] | None = "data/suites/miniwob_click_ood.yaml"
    """Held-out tasks for generalisation. The same file as in_domain_suite: that file's tasks are divided by
    their own `split` (in_domain there, every other one here; pipeline/common.py `suite_tasks`). null: no
    held-out suite (the paper's protocol: train and evaluate on the same tasks); every task of
    in_domain_suite is in-domain and evaluation reports in-domain numbers only."""
    episode_time_limit_s: Annotated[float, Gt(0)] | None = 60.0
    """MiniWoB episode clock (its own default of 10 s fails slow CPU policies); null: no limit."""
    reset_timeout_s: Annotated[float, Gt(0)] = 120.0
    """Limit for one reset (browser start included)."""
    step_timeout_s: Annotated[float, Gt(0)] = 60.0
    """Limit for one step."""
    eval_timeout_s: Annotated[float, Gt(0)] = 60.0
    """Limit for one evaluation."""
    reset_retries: Annotated[int, Ge(1)] = 8
    """Reset attempts before an env is reported failed (reference: 8)."""
    ray_resources: dict[str, Annotated[float, Ge(0)]] = field(default_factory=dict)
    """Custom Ray resources per env actor, e.g. {env_node: 0.01} (backend ray); amounts >= 0."""
    osworld: OSWorldConfig = field(default_factory=OSWorldConfig)
    rollout: RolloutModeConfig = field(default_factory=RolloutModeConfig)
    """Scheduling of env steps and generation in rollouts (train, evaluate, baseline)."""

    def cross_checks(self) -> CrossChecks:
        """Rules across fields, checked by the loader: (field, rule, other fields involved). The suites'
        kind is read from the files when they exist (a missing file is the path check's error)."""
        for name in ("in_domain_suite", "out_of_domain_suite"):
            if getattr(self, name) is None:
                continue
            # a broken suite or a misspelt task fails when params load, not 25 s later inside a stage
            if problem := suite_problem(getattr(self, name)):
                yield (name, f"is not a usable suite: {problem}", ())
                continue
            if problem := unknown_suite_task(getattr(self, name)):
                yield (name, problem, ())
            found = suite_backends(getattr(self, name))
            if found is not None and found != {self.kind}:
                yield (
                    name,
                    f"must hold {self.kind} tasks when kind is {self.kind}; the file's tasks are "
                    f"{', '.join(sorted(found))} tasks",
                    ("kind",),
                )
        o = self.osworld
        if self.kind != "osworld" or o.provider != "remote":
            return
        if not o.base_urls:
            yield (
                "osworld.base_urls",
                "must list at least one server URL when provider is remote",
                ("osworld.provider",),
            )
        elif self.n_envs > len(o.base_urls):
            yield (
                "n_envs",
                f"must be <= len(osworld.base_urls) = {len(o.base_urls)} with provider remote: one env "
                "per URL",
                ("osworld.base_urls", "osworld.provider"),
            )


@dataclass(frozen=True)
class VLLMConfig:
    """The colocated vLLM engine of `policy.backend: vllm` (arpo_core/policy/generate.py,
    decision "Generator backends")."""

    gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """Share of the GPU's memory vLLM may take (weights + KV cache); the trainer shares the GPU, so the
    rest is its (TRL's colocate default is 0.3)."""
    max_model_len: Annotated[int, Ge(256)] = 32768
    """Longest prompt + reply in tokens (a 15-step UI-TARS episode at 1920x1080 is ~40k with all
    screenshots; lower it with policy.history_images)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations of the engine (the trainer's recomputed log-probs stay the loss's)."""
    enforce_eager: bool = False
    """No CUDA graphs: faster start (seconds instead of ~a minute), slower decoding."""
    sleep_mode: bool = False
    """Release the engine's GPU memory (weights and KV cache) during each update and take it back before
    the next rollout (vLLM's sleep(level=1) / wake_up): more memory for a large model's update."""


@dataclass(frozen=True)
class PolicyConfig:
    backend: Literal["hf", "vllm"] = "hf"
    """Who generates replies in baseline, train and evaluate: `hf` (the transformers model itself, CPU or
    GPU) or `vllm` (a vLLM engine colocated on the trainer's GPU that receives the trainer's weights after
    every update; needs a CUDA GPU and the environment of scripts/setup_gpu.sh; the trained policy is then
    put on the GPU with either train.engine)."""
    system_prompt: Literal["uitars", "compact", "qwen3vl", "qwen3vl_compact"] = "compact"
    """Prompt template: the full UI-TARS computer-use prompt, or a short one for tiny CPU models; `qwen3vl`
    and `qwen3vl_compact` the same two for the Qwen3-VL tool-call grammar (docs/models.md). A prompt
    asks for one grammar: it must be `action_format`'s (`qwen3vl*` for qwen3vl_tool_call)."""
    history_images: Annotated[int, Ge(1)] | None = 1
    """Screenshots shown as images, >= 1: the current one at least (older turns keep their text); null:
    all, which keeps the trainer's recomputed log-probs exactly equal to the generator's."""
    max_new_tokens: Annotated[int, Ge(1)] = 64
    """Reply length limit in tokens."""
    coord_mode: Literal["absolute", "relative1000"] = "absolute"
    """Model coordinates: pixels of the smart_resized image (UI-TARS-1.5) or 0-1000 (UI-TARS-1.0,
    GUI-Owl-1.5 / Qwen3-VL)."""
    action_format: Literal["uitars", "qwen3vl_tool_call"] = "uitars"
    """The reply grammar the policy is parsed in and the demos are written in: UI-TARS calls
    (`Thought: ... Action: click(start_box='(x,y)')`) or Qwen3-VL / GUI-Owl-1.5 tool calls (`Action: ...`
    then `<tool_call>{"name": "computer_use", ...}</tool_call>`, 0-1000 coordinates: coord_mode
    relative1000). docs/models.md."""
    click_readout: Literal["tokens", "cell", "block", "guarded"] = "tokens"
    """Where a reply's click comes from: `tokens`, the coordinates the policy writes; `cell` / `block`, the
    screen cell its last layer's pointing head attends to where it starts writing x (the cell's centre, or
    the mass-weighted centre of its 3x3 block), written into the reply in place of the policy's digits;
    `guarded`, the written click where it lies within one cell of that cell, its centre elsewhere
    (policy/heads.py, decision "Clicks read from the pointing head"; generate.py, decision "Read clicks").
    For a policy whose grounding taught that head (`ground.phases[].point_weight`); backend hf, UI-TARS
    replies and absolute coordinates."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def cross_checks(self) -> CrossChecks:
        """Rules across fields, checked by the loader: (field, rule, other fields involved)."""
        if self.click_readout != "tokens" and (
            self.backend != "hf" or self.action_format != "uitars" or self.coord_mode != "absolute"
        ):
            yield (
                "click_readout",
                f"{self.click_readout} needs backend hf, action_format uitars and coord_mode absolute (the "
                "clicks are read from the transformers model's heads into UI-TARS replies in model pixels)",
                ("backend", "action_format", "coord_mode"),
            )
        tool_prompt = self.system_prompt.startswith("qwen3vl")  # policy/prompt.py PROMPT_FORMATS
        if tool_prompt != (self.action_format == "qwen3vl_tool_call"):
            yield (
                "system_prompt",
                f"must ask for the replies action_format {self.action_format} parses: "
                + (
                    "qwen3vl or qwen3vl_compact"
                    if self.action_format == "qwen3vl_tool_call"
                    else "uitars or compact"
                ),
                ("action_format",),
            )
        if self.action_format == "qwen3vl_tool_call" and self.coord_mode != "relative1000":
            yield (
                "coord_mode",
                "must be relative1000 with action_format qwen3vl_tool_call: the prompt announces a 1000x1000 "
                "screen, GUI-Owl-1.5's convention",
                ("action_format",),
            )
        if self.backend == "vllm" and self.vllm.max_model_len <= self.max_new_tokens:
            yield (
                "vllm.max_model_len",
                f"must be > max_new_tokens = {self.max_new_tokens} with backend vllm: a prompt needs room",
                ("max_new_tokens", "backend"),
            )


@dataclass(frozen=True)
class InitPolicyConfig:
    family: Literal["qwen2_5_vl", "qwen3_vl"] = "qwen2_5_vl"
    """Architecture of the tiny model built offline: Qwen2.5-VL (UI-TARS-1.5's) or Qwen3-VL (GUI-Owl-1.5's;
    saved in the Hub's sharded layout). A `pretrained` checkpoint's own config.json decides its family."""
    size: Literal["xs", "s", "m"] = "xs"
    """Tiny architecture built offline (xs 0.7M, s 5.1M, m 36.5M parameters for qwen2_5_vl)."""
    seed: Annotated[int, Ge(0)] = 0
    """Tokenizer corpus and weight initialisation."""
    pretrained: Annotated[str, ExistingPath(checkpoint=True)] | None = None
    """Path of an existing Qwen2.5-VL or Qwen3-VL checkpoint (e.g. UI-TARS-1.5-7B, GUI-Owl-1.5-8B): used
    instead of building one."""
    rope_theta: Annotated[float, Gt(0)] = 5.0
    """Base of the tiny LM's rotary positions. At Qwen's 1e6 a tiny head's M-RoPE h/w bands barely turn
    across the visual tokens and clicks stay image-blind; 5 made them follow the target
    (benchmarks/results/grounding.md)."""
    mrope: Annotated[list[Annotated[int, Ge(0)]], Len(3, 3)] | None = field(default_factory=lambda: [2, 7, 7])
    """(t, h, w) split of head_dim/2 rotary frequencies; null: the family's proportions (Qwen2.5-VL: xs
    [4,6,6], s [8,12,12]; Qwen3-VL, interleaved: xs [6,5,5]). [2,7,7] (xs) is the architecture of the
    grounding recipe and of `ground.checkpoint`. (That the three sum to head_dim/2 of `size`, and fit
    Qwen3-VL's interleaving, is checked when the model is built: the sizes live with the torch code.)"""


@dataclass(frozen=True)
class GroundPhase(GroundTrainConfig):
    """One phase of grounding pretraining (`ground.phases[i]`): the training fields of
    `GroundTrainConfig` (shared with `arpo_core.offline.grounding.GroundConfig`), plus `miniwob_seeds`,
    `grow_after`, `grow_vision_after` and `widen_vision_to`, which the stage applies around the training
    loop (the loop is told which parameters the first two added, for `grown_lr_scale`)."""

    miniwob_seeds: Annotated[int, Ge(0)] = 0
    """Real MiniWoB screens of the in-domain suite's tasks with N env seeds (0..N-1, skipping the held-out
    1000-1999) as a fixed example list (half of every batch); 0 = synthetic screens only."""
    grow_after: list[Annotated[int, Ge(0)]] | None = None
    """Before this phase, insert a zero-output decoder layer after each listed layer index
    (`policy.model.grow_depth`); null = keep the depth."""
    grow_vision_after: list[Annotated[int, Ge(0)]] | None = None
    """Before this phase, insert a zero-output vision block after each listed block index
    (`policy.model.grow_vision_depth`: the tower computes the same tokens until trained); null = keep the
    tower's depth."""
    widen_vision_to: Annotated[int, Ge(1)] | None = None
    """Before this phase (and before `grow_vision_after`), widen the vision tower to this many channels, in
    more heads of the same size (`policy.model.widen_vision`: the same tokens until trained; Qwen2.5-VL
    towers only, and a width the tower's heads divide); null = keep the tower's width."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.until_hit is not None and not self.eval_every:
            raise ValueError(
                f"ground phase: until_hit {self.until_hit} needs eval_every > 0 (the held-out hit rate is "
                "measured every eval_every steps)"
            )
        if self.grown_lr_scale != 1 and not (self.grow_after or self.grow_vision_after):
            raise ValueError(
                "ground phase: grown_lr_scale needs grow_after or grow_vision_after (the rate of what the "
                "phase grows)"
            )
        try:
            super().__post_init__()
        except ValueError as e:
            raise ValueError(f"ground phase: {e}") from None


@dataclass(frozen=True)
class GroundSectionConfig:
    """Grounding pretraining (stage `ground`): where the grounded policy comes from and how it is measured.
    (Not named `GroundConfig`: that is `arpo_core.offline.grounding`'s training-loop config, one per phase.)"""

    checkpoint: Annotated[str, ExistingPath(checkpoint=True)] | None = "assets/checkpoints/grounded-read-xs"
    """Start from this checkpoint directory (the project's versioned grounded tiny policy) instead of
    `models/init`; null = start from `models/init` and train with `phases`. A pretrained model named by
    `init_policy.pretrained` wins over it (this is a tiny model)."""
    phases: list[GroundPhase] = field(default_factory=list)
    """Training phases run in order on the starting policy; empty = use the start as it is."""
    heads_from: Annotated[str, ExistingPath()] | None = None
    """A ground phase's training checkpoint (`models/.grounded.staging/checkpoints/phase-<i>.pt` of another
    run) that the first phase's carried heads start from (its `carry_heads`), so that a run branched from
    another's snapshot (`checkpoint`) keeps that run's heads (grounding.py, decision "Carried heads");
    null = the first phase carries none."""
    eval_levels: list[str] = field(
        default_factory=lambda: [
            *("box1h", "box4", "widget1", "widget4"),
            *("boxes8", "buttons8", "links8", "texts8", "checks8"),  # the reading levels
        ]
    )
    """Held-out synthetic levels measured after training (one measure set per level)."""
    eval_per_level: Annotated[int, Ge(1)] = 64
    """Held-out synthetic screens per level (>= 2 when `eval_levels` is not empty: correlations need two
    points)."""
    eval_miniwob_seeds: Annotated[int, Ge(0)] = 3
    """Held-out real MiniWoB screens: the in-domain suite's tasks with env seeds 1000..1000+N-1;
    0 = none (no browser)."""
    miniwob_per_screen: Annotated[int, Ge(1)] = 4
    """At most this many targets per real MiniWoB screen (training and held-out)."""
    min_pixels: Annotated[int, Ge(784)] | None = None
    """The grounded policy's pixel budget floor (its image processor's `size.shortest_edge`): a screen
    smaller than this is upscaled to about this many pixels before it is cut into 14-px patches, and the
    output checkpoint keeps it, so every later stage sees the screens at that scale. null keeps the
    start's (the tiny policies: MiniWoB's 160x210 at its natural scale, 48 visual tokens). 134400 is 2x
    (180 tokens: a ~7-px glyph fills a patch; the reading lever of presets/ground-reading-2x.yaml)."""
    checkpoint_every_s: Annotated[float, Ge(0)] = 300.0
    """Each phase saves its whole training state this often (and when it ends), in the stage's staged output;
    a killed or interrupted stage restarted with the same params continues each phase where it was, to the
    same weights (grounding.py, decision "Resumable training"). Operational: not in the stage's key."""
    screen_cache: str | None = ".arpo/screens"
    """Where the real MiniWoB screens the stage reads are kept (relative to the project folder), so a
    resumed or re-measured run reads them from disk instead of a browser (envs/miniwob/screens.py,
    decision "Screen cache"); null = read every screen from the browser. Operational: not in the
    stage's key."""

    def __post_init__(self) -> None:
        check_fields(self)

    def cross_checks(self) -> CrossChecks:
        """Rules across fields, checked by the loader: (field, rule, other fields involved)."""
        if self.eval_levels and self.eval_per_level < 2:
            yield "eval_per_level", "must be >= 2 when eval_levels is not empty", ("eval_levels",)
        for i, phase in enumerate(self.phases):
            if i == 0 and self.heads_from is not None:
                continue  # carried from a file: its heads are checked when the phase starts
            if phase.carry_heads and (problem := _carry_problem(self.phases[i - 1] if i else None, phase)):
                yield f"phases.{i}.carry_heads", f"is not usable: {problem}", ()
        if self.heads_from is not None and not (self.phases and self.phases[0].carry_heads):
            yield "heads_from", "is not usable without the first phase's carry_heads (where they start)", ()


def _carry_problem(prev: GroundPhase | None, phase: GroundPhase) -> str | None:
    """Why `phase` cannot carry its heads from `prev` (the phase before it; None for the first), or None
    (grounding.py, decision "Carried heads")."""
    if prev is None:
        return "the first phase has no previous phase to carry heads from (ground.heads_from names a file)"
    if not any(getattr(phase, weight) for _, _, weight, _ in TRAINED_HEADS):
        return "the phase trains no head (name_weight, spell_weight, place_weight and match_weight are 0)"
    carried = phase.carry_heads
    for key, what, weight, kind in TRAINED_HEADS:
        if not getattr(phase, weight) or (carried is not True and key not in carried):
            continue
        if not getattr(prev, weight):
            return f"the previous phase trains no {what} ({weight} 0)"
        for k in kind:
            if getattr(prev, k) != getattr(phase, k):
                return f"the previous phase's {what} has {k} {getattr(prev, k)!r}, this one {getattr(phase, k)!r}"
    return None


@dataclass(frozen=True)
class DemosConfig:
    episodes_per_task: Annotated[int, Ge(0)] = 80
    """Oracle episodes per in-domain task (seeded, distinct instances). 0: no demos and no behaviour
    cloning - the `sft` stage passes the grounded policy through as the base (a pretrained checkpoint
    such as UI-TARS, or suites without scripted oracles, e.g. OSWorld's own tasks)."""
    seed: Annotated[int, Ge(0)] = 100000
    """First env seed of the demos (kept apart from evaluation seeds)."""
    recovery_rate: Annotated[float, Interval(ge=0, le=1)] = 0.5
    """Fraction of episodes (a seeded draw per episode) in which the oracle first misses, clicking empty
    space, then solves the task: recovery demos teach replies after a history (arpo_core/offline/demonstrations.py)."""
    max_misses: Annotated[int, Ge(1)] = 2
    """A recovery episode starts with 1..max_misses misses (uniform); the misses are context, not trained."""
    thoughts: Literal["oracle", "brief"] = "brief"
    """The Thought of each demo reply: `oracle` keeps the oracle's own (it names the target, e.g. `The link
    "cioi" is in the text; I click it.`), `brief` replaces it with one fixed sentence
    (arpo_core/offline/demonstrations.py, decision "Brief thoughts"), leaving the policy fewer free-text
    tokens to reproduce."""


@dataclass(frozen=True)
class BaselineConfig:
    episodes_per_task: Annotated[int, Ge(1)] = 16
    """Base-policy rollouts per task for task selection (paper: 16)."""
    temperature: Annotated[float, Ge(0)] = 1.0
    """Sampling temperature of those rollouts (0: greedy)."""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """Nucleus sampling mass of those rollouts (1: the whole distribution)."""
    max_steps: Annotated[int, Ge(1)] = 3
    """Episode step limit."""
    seed: Annotated[int, Ge(0)] = 200000
    """First env seed."""


@dataclass(frozen=True)
class EvaluateConfig:
    episodes_per_task: Annotated[int, Ge(1)] = 50
    """Episodes per task and split (>= 50 to see a 10-point change, docs/method.md §7)."""
    temperature: Annotated[float, Ge(0)] = 0.0
    """0: greedy. The paper evaluates with 0.5-0.6; `sampled_temperature` adds that mode."""
    sampled_temperature: Annotated[float, Gt(0)] | None = None
    """Also evaluate sampled at this temperature, > 0 (null: greedy only; the paper's 0.5-0.6)."""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """Nucleus sampling mass of the sampled evaluations (1: the whole distribution)."""
    samples_per_instance: Annotated[int, Ge(1)] = 4
    """Sampled episodes of each pinned instance (a greedy evaluation plays one: it is determined by the
    instance); task families play `episodes_per_task` fresh instances instead."""
    max_steps: Annotated[int, Ge(1)] = 3
    """Episode step limit."""
    seed: Annotated[int, Ge(0)] = 900000
    """First env seed (disjoint from demos, baseline and training seeds)."""
    osworld_hard: bool = False
    """Score with the OSWorld-Hard rule (step limit + FAIL scores 0)."""
    during_training: Annotated[int, Ge(0)] = 0
    """Also evaluate the policy being trained every N epochs and after the last one (the in-domain
    suite at `temperature`, env seeds from `seed` as here), into the train history; 0 = off."""
    during_training_episodes: Annotated[int, Ge(1)] = 50
    """Episodes per task of those evaluations (their instances are the first ones of this stage's)."""


@dataclass(frozen=True)
class CompareConfig:
    """The comparison table (stage `compare`)."""

    reference: str = "base"
    """The policy every other one is paired against, episode by episode on the shared instances."""
    image_blind: bool = True
    """Read the DOM targets of the evaluation instances (one browser, click-oracle tasks) for the
    image-blind ceiling and click alignment; false: no browser, no ceiling."""


@dataclass(frozen=True)
class LossSection:
    clip_low: Annotated[float, Interval(gt=0, lt=1)] = 0.2
    """PPO clip below: ratio >= 1 - clip_low (in (0, 1): the bound stays a positive ratio)."""
    clip_high: Annotated[float, Gt(0)] = 0.3
    """PPO clip above (asymmetric, 'clip-higher'): ratio <= 1 + clip_high."""
    clip_dual: Annotated[float, Gt(1)] | None = 3.0
    """Dual-clip constant c (> 1) for negative advantages; null switches the dual clip off."""
    kl_coef: Annotated[float, Ge(0)] = 0.0
    """KL penalty to the reference policy; ARPO uses 0 (no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator when kl_coef > 0."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are reduced (verl's agg_loss modes)."""
    sum_norm: Annotated[float, Gt(0)] | None = None
    """Fixed divisor for seq-mean-token-sum-norm (null: the padded length, as verl)."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Std used to normalise group-relative advantages: per group, whole batch, or none (Dr. GRPO)."""
    advantage_eps: Annotated[float, Gt(0)] = 1e-6
    """Added to the std before dividing (verl 1e-6; TRL 1e-4)."""
    format_penalty: Annotated[float, Le(0)] = -1.0
    """Reward of an unparseable reply, <= 0 (paper -1; reference code -0.5)."""


@dataclass(frozen=True)
class DistributedSection:
    """Data-parallel ranks (arpo_core/algorithm/distributed.py): how `arpo stage train` joins the ranks a
    launcher (`torchrun`, `deepspeed`) started. Operational: results do not depend on these."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto = nccl when CUDA is available, else gloo."""
    timeout_s: Annotated[float, Gt(0)] = 1800.0
    """Collective timeout: a rank that waits longer for the others (a hung rank) ends the job with an
    error instead of hanging it; it must exceed rank 0's evaluations between epochs."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trained policy lives: auto = this rank's GPU (cuda:LOCAL_RANK) when CUDA is available,
    else the CPU."""


@dataclass(frozen=True)
class TrainConfig:
    seed: Annotated[int, Ge(0)] | None = None
    """The training run's seed (task order, instances, sampling, replay draws, mini-batches); null =
    project.seed. A multi-seed study varies this one, so the base, its baseline rollouts and the task
    selection stay the same for every seed."""
    epochs: Annotated[int, Ge(1)] = 10
    """Passes over the selected task set."""
    tasks_per_iteration: Annotated[int, Ge(1)] = 16
    """Tasks per rollout batch (reference: 16)."""
    group_size: Annotated[int, Ge(2)] = 8
    """Rollouts per task, G (reference: 8); >= 2, a group-relative advantage needs two."""
    groups_per_task: Annotated[int, Ge(1)] = 1
    """Groups per task per iteration, each on its own task instance (env seed): small groups keep the
    rollouts per task of one update (G=4 x 4 groups = 16 rollouts per task, like G=16 x 1)."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4, weight_decay=1e-2))
    """AdamW (reference: lr 1e-6 for a 7B model, weight decay 1e-2; the tiny policy needs a larger lr),
    gradient clip and bf16 autocast."""
    micro_batch_size: Annotated[int, Ge(1)] = 16
    """Trajectories per forward/backward; <= mini_batch_size."""
    mini_batch_size: Annotated[int, Ge(1)] = 64
    """Trajectories per optimizer step (reference: 64, i.e. 2 steps per 128-trajectory iteration)."""
    ppo_epochs: Annotated[int, Ge(1)] = 1
    """Optimisation passes over each rollout batch."""
    temperature: Annotated[float, Ge(0)] = 1.0
    """Sampling temperature during training rollouts."""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """Nucleus sampling during training rollouts."""
    max_steps: Annotated[int, Ge(1)] = 3
    """Episode step limit."""
    use_selection: bool = True
    """Train on the selected tasks (true) or on the whole in-domain suite (false)."""
    engine: Literal["torch", "deepspeed"] = "torch"
    """Training engine."""
    zero_stage: Annotated[int, Interval(ge=0, le=3)] = 2
    """DeepSpeed ZeRO stage (engine deepspeed). ZeRO-3 cannot accumulate gradients over micro-batches
    (engines.py): it needs micro_batch_size >= the mini-batch."""
    skip_zero_advantage: bool = False
    """Leave sequences with advantage exactly 0 out of the update (compute saving; the reference keeps
    them, which also dilutes the token-mean)."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward instead of keeping them (policy/model.py,
    decision "Gradient checkpointing"): the same gradients for about one more forward, what lets a
    15-screenshot trajectory of a 7B model fit beside its optimizer states. Operational: not in the key."""
    image_blind: bool = False
    """The image-blind control arm: the trained policy sees a blank screenshot of the same size wherever
    it would see one, in training rollouts, in the update and in its evaluations (the base it starts from,
    the baseline and the selection are the other arms'): what it reaches on the training instances is
    what memorising instructions alone buys."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    loss: LossSection = field(default_factory=LossSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def cross_checks(self) -> CrossChecks:
        """Rules across fields, checked by the loader: (field, rule, other fields involved)."""
        if self.micro_batch_size > self.mini_batch_size:
            yield "micro_batch_size", "must be <= mini_batch_size", ("mini_batch_size",)
        batch = self.tasks_per_iteration * self.groups_per_task * self.group_size  # one iteration's rollouts
        if (
            self.engine == "deepspeed"
            and self.zero_stage == 3
            and self.micro_batch_size < min(self.mini_batch_size, batch)
        ):
            rollouts = "tasks_per_iteration * group_size"
            if self.groups_per_task > 1:
                rollouts = "tasks_per_iteration * groups_per_task * group_size"
            yield (
                "micro_batch_size",
                f"must be >= min(mini_batch_size, {rollouts}) with DeepSpeed ZeRO-3, "
                "which cannot accumulate gradients over micro-batches (engines.py)",
                (
                    "mini_batch_size",
                    "tasks_per_iteration",
                    "groups_per_task",
                    "group_size",
                    "engine",
                    "zero_stage",
                ),
            )


@dataclass(frozen=True)
class Params:
    """The whole params file: shared sections (project, env, policy), then one per pipeline stage in
    order. The sections whose code lives elsewhere (`ReplayConfig`, `SelectConfig`, `SFTConfig`,
    `RFTConfig`, `DPOConfig`, `KTOConfig`) are defined in config/sections.py, so parsing params imports
    none of that code."""

    project: ProjectConfig = field(default_factory=ProjectConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    init_policy: InitPolicyConfig = field(default_factory=InitPolicyConfig)
    ground: GroundSectionConfig = field(default_factory=GroundSectionConfig)
    demos: DemosConfig = field(default_factory=DemosConfig)
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=1200, warmup_steps=20, min_lr_frac=0.05))
    """Behaviour cloning of the base policy: the main job's 1200 steps with warm-up and cosine decay (the
    same `SFTConfig` inside `rft` keeps its own defaults, RFT's 100 steps at a constant rate)."""
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    rft: RFTConfig = field(default_factory=RFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def cross_checks(self) -> CrossChecks:
        """Rules across sections, checked by the loader: (key, rule, other keys involved)."""
        if self.train.use_selection and self.select.min_successes > self.baseline.episodes_per_task:
            yield (
                "select.min_successes",
                "must be <= baseline.episodes_per_task when train.use_selection is true: no task could be "
                "kept",
                ("baseline.episodes_per_task", "train.use_selection"),
            )
        yield from self._instance_overlaps()
        yield from self._family_rules()
        if self.env.kind != "miniwob":  # real MiniWoB screens need MiniWoB pages
            if self.ground.eval_miniwob_seeds:
                yield (
                    "ground.eval_miniwob_seeds",
                    f"must be 0 when env.kind is {self.env.kind}: the held-out real screens are MiniWoB pages",
                    ("env.kind",),
                )
            if any(ph.miniwob_seeds for ph in self.ground.phases):
                yield (
                    "ground.phases",
                    f"must have miniwob_seeds 0 in every phase when env.kind is {self.env.kind}: real "
                    "training screens are MiniWoB pages",
                    ("env.kind",),
                )

    def _family_rules(self) -> CrossChecks:
        """docs/models.md: the grounded start must be of the family `init_policy` builds, and the grounding
        recipe (UI-TARS replies in Qwen2.5-VL's frame) runs only with the UI-TARS grammar."""
        ip, g = self.init_policy, self.ground
        if ip.pretrained is None and g.checkpoint is not None:
            found = checkpoint_model_type(g.checkpoint)
            if found is not None and found != ip.family:
                yield (
                    "ground.checkpoint",
                    f"must be a {ip.family} checkpoint like the one init_policy.family builds, or null; "
                    f"its config.json says {found}",
                    ("init_policy.family",),
                )
        pointing = self.policy.action_format != "uitars" or self.policy.coord_mode != "absolute"
        for key, sft in (("sft", self.sft), ("rft.sft", self.rft.sft)):
            if sft.point_weight and pointing and (key == "rft.sft" or self.demos.episodes_per_task):
                yield (
                    f"{key}.point_weight",
                    "must be 0 unless policy.action_format is uitars and policy.coord_mode absolute: the "
                    "pointing loss finds each click's cell from UI-TARS replies in model pixels",
                    ("policy.action_format", "policy.coord_mode"),
                )
        if self.policy.action_format != "uitars":
            measures = bool(g.eval_levels or g.eval_miniwob_seeds) and ip.pretrained is None
            if g.phases or measures:
                yield (
                    "ground.phases" if g.phases else "ground.eval_levels",
                    "must be empty (and ground.eval_levels [], eval_miniwob_seeds 0) with policy.action_format "
                    f"{self.policy.action_format}: the grounding recipe writes and reads UI-TARS replies",
                    ("policy.action_format", "ground.eval_miniwob_seeds"),
                )

    def instance_roles(self) -> dict[str, dict[tuple[str, str], set[int]]]:
        """Per role, {(domain, task family): the env seeds it plays} (pipeline/common.py `instance_roles`):
        `demos` (`demos.seed + k` of every in-domain family), `train` (the pinned in-domain instances),
        `heldout` (`evaluate.seed + k` of every in-domain family, as many as the evaluate stage or the
        evaluations during training play) and `out_of_domain` (the out-of-domain suite's, likewise)."""
        from arpo_core.config.suites import load_suite, pinned_seeds

        def load(path: str | None) -> list:
            try:
                return load_suite(path) if path is not None else []
            except (SuiteError, OSError):  # EnvConfig's checks name the problem
                return []

        ind, ood = load(self.env.in_domain_suite), load(self.env.out_of_domain_suite)
        same = (
            ood and Path(self.env.in_domain_suite).resolve() == Path(self.env.out_of_domain_suite).resolve()
        )
        if same:  # one file for both suites: divided by the tasks' own split (pipeline/common.py)
            ind, ood = [t for t in ind if t.split == "in_domain"], [t for t in ind if t.split != "in_domain"]
        e, d = self.evaluate, self.demos
        n_eval = max(e.episodes_per_task, e.during_training_episodes if e.during_training else 0)
        fams = {(t.domain, t.family) for t in ind}
        return {
            "demos": {f: set(range(d.seed, d.seed + d.episodes_per_task)) for f in fams},
            "train": pinned_seeds(ind),
            "heldout": {f: set(range(e.seed, e.seed + n_eval)) for f in fams},
            "out_of_domain": {
                **{
                    (t.domain, t.family): set(range(e.seed, e.seed + e.episodes_per_task))
                    for t in ood
                    if not t.pinned
                },
                **pinned_seeds(ood),
            },
        }

    def _instance_overlaps(self) -> CrossChecks:
        """pipeline/common.py `instance_roles`: no env seed of a task family in two roles."""
        roles = self.instance_roles()
        keys = {"demos": "demos.seed", "train": "env.in_domain_suite", "heldout": "evaluate.seed"}
        names = list(roles)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                for fam in sorted(set(roles[a]) & set(roles[b])):
                    both = roles[a][fam] & roles[b][fam]
                    if both:
                        yield (
                            keys.get(a, "env.out_of_domain_suite"),
                            f"is not usable: {fam[1]} plays env seed {min(both)} as {a} and as {b} instances "
                            f"({len(both)} shared); demonstrations, training, held-out and out-of-domain "
                            "instances must be disjoint",
                            (keys.get(b, "env.out_of_domain_suite"),),
                        )
                        return


# --------------------------------------------------------------------------------------------------
# Loading


def _file_sources(kind: str, file: Path | str, lines: Mapping[KeyPath, int]) -> Callable[[KeyPath], Source]:
    def at(path: KeyPath) -> Source:
        line = lines.get(path)
        return Source(kind, f"{file}:{line}" if line else str(file))

    return at


def parse_params(
    raw: Mapping[str, Any] | None, file: str = "<params>", *, check_paths: bool = False
) -> Params:
    """Validate a parsed params mapping into `Params`; errors name `file` as the source of every key.
    Paths are only checked against the filesystem with `check_paths` (`load_params` does)."""
    provenance = Provenance()
    raw = raw or {}
    source_at = _file_sources("params file", file, {})
    for k, v in raw.items():
        provenance.replace((k,), v, source_at)
    return build(Params, raw, (), Context(provenance, check_paths))


def apply_overrides(raw: Mapping[str, Any] | None, overrides: Sequence[str]) -> dict[str, Any]:
    """Apply DVC-style `a.b.c=value` overrides (values parsed as YAML) to a raw params mapping."""
    out = _deepcopy(raw or {})
    for item in overrides:
        _apply_override(out, item, None)
    return out


def _apply_override(out: dict[str, Any], item: str, provenance: Provenance | None) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted_key, text = item.split("=", 1)
    keys = tuple(dotted_key.strip().split("."))
    source = Source("command-line override", f"-S {item}")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: the value is not valid YAML: {_yaml_problem(e)}") from None
    path: list[str | int] = []
    node: Any = out
    for k in keys:  # a list item is named by its index: ground.phases.0.seed=21
        if isinstance(node, list):
            if not (k.isdigit() and int(k) < len(node)):
                raise ConfigError(
                    f"override {item!r}: '{dotted(tuple(path))}' is a list of {len(node)}, "
                    f"so '{k}' must be an index 0..{len(node) - 1}"
                )
            path.append(int(k))
        elif isinstance(node, dict):
            path.append(k)
        else:
            raise ConfigError(f"override {item!r}: '{path[-1]}' is not a section")
        if len(path) == len(keys):
            break
        if isinstance(node, dict) and k not in node:
            node[k] = {}
            if provenance is not None:
                provenance.replace(tuple(path), {}, lambda _: source)
        node = node[path[-1]]
    node[path[-1]] = value
    if provenance is not None:
        provenance.replace(tuple(path), value, lambda _: source)


def _deepcopy(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, Mapping) else copy.deepcopy(v) for k, v in m.items()}


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error's problem and context in one line."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return " ".join(str(e).split())
    text = e.problem or e.context or "syntax error"
    if e.problem and e.context:
        mark = e.context_mark
        text += f" ({e.context}" + (f" at line {mark.line + 1}, column {mark.column + 1})" if mark else ")")
    return " ".join(str(text).split())


def _read_yaml(path: Path, kind: str) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    """A params or preset file as a mapping, and the line of every key in it."""
    if not path.is_file():
        raise ConfigError(f"{kind} not found: {path}")
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        raw = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {_yaml_problem(e)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {_yaml_problem(e)}") from None
    finally:
        loader.dispose()
    if raw is None or raw == {}:
        raise ConfigError(
            f"{path}: the {kind} is empty (nothing but comments or whitespace); it must set sections"
        )
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    lines: dict[KeyPath, int] = {}
    _key_lines(node, (), lines, path)
    return dict(raw), lines


def _key_lines(node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], file: Path) -> None:
    """The line of every key (and list item) below `node`; a key written twice in one mapping is an
    error (YAML would keep the last one silently)."""
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":  # merge keys: no lines
                continue
            key = (*path, key_node.value)
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise ConfigError(f"{file}:{line}: duplicate key {dotted(key)} (first at line {lines[key]})")
            seen.add(key_node.value)
            lines[key] = line
            _key_lines(value_node, key, lines, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _key_lines(item, (*path, i), lines, file)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: sections merge key by key, leaves of `over` win."""
    out = _deepcopy(base)
    _overlay(out, over, (), None, None)
    return out


def _overlay(
    dst: dict[str, Any],
    over: Mapping[str, Any],
    path: KeyPath,
    provenance: Provenance | None,
    source_at: Callable[[KeyPath], Source] | None,
) -> None:
    """Merge `over` into `dst` in place (mappings key by key, anything else replaced), recording sources."""
    for k, v in over.items():
        key = (*path, k)
        if isinstance(v, Mapping) and isinstance(dst.get(k), Mapping):
            if provenance is not None and source_at is not None:
                provenance.touch(key, source_at(key))
            _overlay(dst[k], v, key, provenance, source_at)
        else:
            dst[k] = _deepcopy(v) if isinstance(v, Mapping) else copy.deepcopy(v)
            if provenance is not None and source_at is not None:
                provenance.replace(key, v, source_at)


def _preset_path(params_path: Path, preset: str | Path) -> Path:
    """A preset given as a file, or as a name: presets/NAME.yaml beside the params file."""
    given = Path(preset)
    if given.exists() or given.suffix:
        return given
    named = params_path.parent / "presets" / f"{preset}.yaml"
    if named.is_file():
        return named
    available = sorted(p.stem for p in named.parent.glob("*.yaml"))
    raise ConfigError(
        f"unknown preset {str(preset)!r}; available presets ({named.parent / '*.yaml'}): "
        f"{', '.join(available) if available else 'none'}"
    )


def load_params(
    path: str | Path = "params.yaml", overrides: Sequence[str] = (), preset: str | Path | None = None
) -> Params:
    """Read a params file, merge a preset file over it (a partial params file, e.g. presets/quick.yaml, or
    its name, e.g. quick), apply dotted overrides, validate types, ranges, paths and cross-field rules.
    Every error names the key, the value and its source (file:line, preset:line or the override)."""
    path = Path(path)
    provenance = Provenance()
    raw, lines = _read_yaml(path, "params file")
    data: dict[str, Any] = {}
    _overlay(data, raw, (), provenance, _file_sources("params file", path, lines))
    if preset is not None:
        preset_path = _preset_path(path, preset)
        over, preset_lines = _read_yaml(preset_path, "preset")
        _overlay(data, over, (), provenance, _file_sources("preset", preset_path, preset_lines))
    for item in overrides:
        _apply_override(data, item, provenance)
    return build(Params, data, (), Context(provenance, check_paths=True))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as plain nested dicts (for MLflow params and JSON)."""
    return dataclasses.asdict(cfg)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'replay': {'enabled': True}}} -> {'train.replay.enabled': True}; an empty mapping is a
    value of its own (`{'a': {}}` -> `{'a': {}}`). The one flatten: stage keys, MLflow params and the
    changed-params tag all use it."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out
