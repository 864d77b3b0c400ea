"""Configs of the sections whose code lives elsewhere: experience replay (`train.replay`, replay.py), task
selection (`select`, selection.py) and the offline training methods (grounding, behaviour cloning, RFT,
DPO, KTO; grounding.py, behaviour_cloning.py, preference.py). Kept here, free of torch, pyarrow and PIL,
so that params.yaml is parsed and validated without importing the code they configure (`arpo params`
stays fast); replay.py and selection.py re-export theirs.

Ranges are declared on the fields (`Annotated[int, Ge(1)]`, annotated_types) and checked by the params
loader (`arpo_core.config`); rules across fields are the sections' `cross_checks`, checked there too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Interval, MinLen

from arpo_core.config.check import check_fields

__all__ = [
    "DPOConfig",
    "GroundTrainConfig",
    "KTOConfig",
    "OptimizerConfig",
    "RFTConfig",
    "ReplayConfig",
    "SFTConfig",
    "SelectConfig",
]


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer of a training section (`train`, `sft`, `dpo`, `kto`, each `ground` phase): AdamW with
    gradient-norm clipping, and the autocast the forward passes run in. Declared once; each section says its
    own learning rate (no default here: the right one depends on what is trained and how big it is)."""

    lr: Annotated[float, Gt(0)]
    """AdamW (peak) learning rate."""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay."""
    max_grad_norm: Annotated[float, Gt(0)] = 1.0
    """Gradient-norm clip."""
    bf16: bool = False
    """bf16 autocast of the forward passes (CPU or GPU); parameters and optimizer states stay fp32 (under
    DeepSpeed with bf16 on, its engine keeps bf16 weights and fp32 master copies)."""


TRAINED_HEADS = (
    ("head", "naming head", "name_weight", ("name_vocab", "name_tied", "name_token")),
    ("speller", "spelling head", "spell_weight", ()),
    ("probe", "place probe", "place_weight", ()),
    ("matcher", "match head", "match_weight", ("name_vocab",)),
)
"""The heads a grounding phase may train beside the model, each its own (arpo_core/offline/grounding.py,
decision "Carried heads"): (its key in a phase's training checkpoint, its name, the weight that turns it on,
the fields that decide its shape and kind)."""


@dataclass(frozen=True)
class GroundTrainConfig:
    """Grounding-pretraining hyperparameters shared by a params phase (`config.GroundPhase`) and the
    training loop's config (`grounding.GroundConfig`), which each add their own fields."""

    def __post_init__(self) -> None:
        """The naming fields' rules, checked for a params phase and the loop's config alike."""
        if self.name_only and not self.name_weight:
            raise ValueError("name_only needs name_weight > 0 (it trains the naming loss alone)")
        if self.name_tied and not self.name_weight:
            raise ValueError("name_tied needs name_weight > 0 (it is the naming loss's head)")
        if self.name_token and not self.name_weight:
            raise ValueError("name_token needs name_weight > 0 (it is the naming loss's head)")
        if self.name_token and self.name_tied:
            raise ValueError("name_token and name_tied are two kinds of naming head: choose one")
        if self.name_vocab != "fixed" and not self.name_weight:
            raise ValueError(
                f"name_vocab {self.name_vocab!r} needs name_weight > 0 (it is what the naming loss names)"
            )
        if self.point_weight and self.name_only:
            raise ValueError("point_weight needs the clicks: a name_only phase encodes no reply")
        if self.point_first and not self.point_weight:
            raise ValueError(
                "point_first needs point_weight > 0 (it chooses where the pointing loss is taught)"
            )
        if self.place_weight and self.name_only:
            raise ValueError("place_weight needs the language model: a name_only phase runs the tower alone")
        if (self.match_warmup or self.match_lr_scale != 1) and not self.match_weight:
            raise ValueError(
                "match_warmup and match_lr_scale need match_weight > 0 (they shape the match loss)"
            )
        if self.match_weight and self.name_only:
            raise ValueError("match_weight needs the language model: a name_only phase runs the tower alone")
        if not isinstance(self.carry_heads, bool):
            weights = {k: w for k, _, w, _ in TRAINED_HEADS}
            for key in self.carry_heads:
                weight = weights[key]
                if not getattr(self, weight):
                    raise ValueError(
                        f"carry_heads lists {key!r}, which this phase does not train ({weight} 0)"
                    )

    steps: Annotated[int, Ge(1)] = 2000
    """Optimizer steps."""
    batch_size: Annotated[int, Ge(1)] = 16
    """Examples per optimizer step (half from a fixed example list when one is given, e.g. real MiniWoB
    screens; the rest fresh synthetic screens)."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=3e-3, bf16=True))
    """AdamW (lr, weight decay, clip) and bf16 autocast; parameters and optimizer state stay fp32."""
    warmup_steps: Annotated[int, Ge(0)] = 50
    """Linear warm-up from 0 to `optimizer.lr` over this many steps."""
    min_lr_frac: Annotated[float, Interval(ge=0, le=1)] = 0.1
    """Cosine decay from `optimizer.lr` to `min_lr_frac * optimizer.lr` at the last step."""
    mix: Annotated[dict[str, Annotated[float, Gt(0)]], MinLen(1)] = field(
        default_factory=lambda: {"box1": 1.0}
    )
    """Synthetic level -> sampling weight (levels of `arpo_core.offline.grounding.LEVELS`); at least one level,
    weights > 0."""
    seed: Annotated[int, Ge(0)] = 0
    """Seed of the stream of synthetic screens and of the fixed list's order (held-out sets use other
    seeds)."""
    eval_every: Annotated[int, Ge(0)] = 0
    """Measure the held-out sets every N steps (greedy clicks: the curves, and the test of `until_hit`);
    0 = only at the end."""
    until_hit: Annotated[float, Interval(gt=0, le=1)] | None = None
    """End early, at a measurement, once the held-out hit rate reaches this on every gated set (the ground
    stage gates on the phase's own levels, not on the real screens: the curriculum's advance to its next
    level, grounding.py decision "Reading curriculum"); `steps` is then the most it trains; null = always
    `steps`. Needs `eval_every` > 0."""
    read_aloud: bool = False
    """Synthetic replies first read every look-alike on the screen in reading order, then name and click
    the target ("I see next, back, ok. I will click the button ok."): the reading supervised token by
    token, not only through the click (arpo_core/offline/grounding.py, decision "Reading aloud")."""
    vision_lr_scale: Annotated[float, Gt(0)] = 1.0
    """The vision tower's learning rate as a multiple of `optimizer.lr` (the language model's). Measured
    (arpo_core/offline/grounding.py, decision "Naming loss"): a fresh tiny tower taught words at 1e-3
    without warm-up stays at the chance loss where 3e-4 learns, yet in the ground stage, from the grounded
    base with warm-up, the full 1.5e-3 taught the naming head words faster than 0.2x did."""
    grown_lr_scale: Annotated[float, Gt(0)] = 1.0
    """The learning rate of the layers and blocks a phase grew (`grow_after`, `grow_vision_after`) as a
    multiple of their part's rate (the tower's includes `vision_lr_scale`): a zero-output layer at the
    model's rate stayed nearly silent for 2,000 steps (arpo_core/offline/grounding.py, decision "Grown
    layers' rate"); 1.0 = the part's rate. Needs a phase that grows."""
    name_weight: Annotated[float, Ge(0)] = 0.0
    """Weight of the naming loss added to the click loss: a linear head of the phase names every look-alike
    of the batch's synthetic screens (its colour or word) from the merged image tokens around it, which
    supervises the vision tower's glyph features directly (arpo_core/offline/grounding.py, decision "Naming
    loss"); 0 = off, the stream and the model as without the field."""
    name_tied: bool = False
    """The naming head scores each window token against the language model's own (detached) input
    embedding of the name (`TiedNameHead`: cosine, the best token of the window, one learned scale) instead
    of a linear map: the tower is taught to make a word's image token look like the word's text token, so
    the click's instruction and the screen meet in one space (arpo_core/offline/grounding.py, decision
    "Naming loss"; measured there: it teaches the words, and beside the clicks it breaks them). Needs
    `name_weight` > 0."""
    name_token: bool = False
    """The naming head names a look-alike from its best single image token instead of the whole window
    (`TokenNameHead`: one linear map of each merged token whose centre lies in the look-alike's box, the
    highest logit per name), so the tower is taught to put the whole word into one token, the form a
    pointing head, which attends token by token, can find (arpo_core/offline/grounding.py, decision "Naming
    loss"). Needs `name_weight` > 0; not with `name_tied`."""
    name_vocab: Literal["fixed", "lorem"] = "fixed"
    """What the naming loss names: `fixed`, the synthetic screens' colours and 50 words (`NAMES`); `lorem`,
    those and the lorem-ipsum words MiniWoB's links and paragraphs are made of (the installed MiniWoB's own
    list, and `LOREM`), on real screens as on synthetic ones, so the words click-link asks for are taught
    to the tower as the 50 were (arpo_core/offline/grounding.py, decision "Lorem names"). Needs
    `name_weight` > 0."""
    name_only: bool = False
    """Train the naming loss alone (needs `name_weight` > 0): all-synthetic batches, no reply encoded, the
    language model untouched, only the vision tower and the head learn; a tower's word phase before the
    click levels (arpo_core/offline/grounding.py, decision "Naming loss")."""
    read_share: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """Share of the synthetic screens drawn as reading examples ("Read the buttons from top to bottom." ->
    finished(content='next, back, ok')) instead of clicks (arpo_core/offline/grounding.py, decision
    "Reading examples"); 0 = clicks only, the same stream of screens as without the field."""
    point_weight: Annotated[float, Ge(0)] = 0.0
    """Weight of the pointing loss added to the click loss: attention heads of the language model's last
    layer (`point_heads`) are taught to attend, from the positions that predict the click's coordinates, to
    the image tokens under the target (GUI-Actor's action-token attention, on stock heads), so the retrieval
    of the named target is supervised directly instead of through a few coordinate digits
    (arpo_core/offline/grounding.py, decision "Pointing loss"); 0 = off, the stream and the model as
    without the field."""
    point_heads: Annotated[int, Ge(1)] = 1
    """How many query heads of the last layer the pointing loss teaches (the first ones, 1..heads): one
    leaves the others free to place the click as they learned to; all of them leave the click only what
    the heads point at (arpo_core/offline/grounding.py, decision "Pointing loss")."""
    point_first: bool = False
    """Teach the pointing loss only at the two positions that predict the first character of x and of y,
    not at every coordinate position: teacher-forced, the later positions have read the right digits
    before them, so their attention can sit on the target without the retrieval, and they outnumbered the
    two that decide the click (arpo_core/offline/grounding.py, decision "First digits"). Needs
    `point_weight` > 0; off = every coordinate position, as before."""
    place_weight: Annotated[float, Ge(0)] = 0.0
    """Weight of the place loss added to the click loss: a linear probe of the phase (in its checkpoint, then
    discarded) reads each image token's row and column from its hidden state where the last decoder layer
    reads it, so the layers before are taught to write where a token is into what it carries, and a head
    that points at the target reads its place with it (arpo_core/offline/grounding.py, decision "Place
    loss"); 0 = off, the stream and the model as without the field."""
    spell_weight: Annotated[float, Ge(0)] = 0.0
    """Weight of the spelling loss added to the click loss: a linear head of the phase says which letters
    and digits each look-alike word of the batch's synthetic screens holds (open words too, which the
    naming loss's fixed head cannot name), from the merged image tokens around it, so the vision tower is
    taught features of characters rather than of 50 words (arpo_core/offline/grounding.py, decision
    "Spelling loss"); 0 = off, the stream and the model as without the field."""
    quote_names: bool = False
    """Training replies name the target as the instruction quotes it ('I will click the label "vdtCA".'
    where the instruction says 'Click on the "vdtCA" label.'), so the thought's tokens of the name are the
    instruction's and copying them is a lookup, not a mapping of each word's first token to its spaced
    twin (arpo_core/offline/grounding.py, decision "Quoted names"); off = the thoughts as before."""
    match_weight: Annotated[float, Ge(0)] = 0.0
    """Weight of the match loss added to the click loss: one linear head of the phase (in its checkpoint, then
    discarded) names, from the states the last decoder layer's attention reads, both the word the click's
    query positions are after (the target's name) and each named look-alike's word from its image tokens, so
    that the query and the keys come to carry a word the same way and the pointing head can match any word
    by one alignment instead of learning one per word (arpo_core/offline/grounding.py, decision "Match
    loss"). Names as `name_vocab` gives them; 0 = off, the stream and the model as without the field."""
    match_warmup: Annotated[int, Ge(0)] = 0
    """The phase's first steps in which the match loss trains its head alone (the states it reads detached,
    so its gradient does not reach the model): a fresh head's gradient is a random direction, and the head
    should read the states before it shapes them (arpo_core/offline/grounding.py, decision "Match loss");
    0 = from the first step."""
    match_lr_scale: Annotated[float, Gt(0)] = 1.0
    """The match head's learning rate as a multiple of `optimizer.lr` (a linear head over ~200 names learns
    slowly at the model's rate; arpo_core/offline/grounding.py, decision "Match loss")."""
    carry_heads: bool | tuple[Literal["head", "speller", "probe", "matcher"], ...] = False
    """The phase's naming head (`head`), spelling head (`speller`), place probe (`probe`) and match head
    (`matcher`) start where the previous phase's ended (read from its checkpoint, or for the first phase
    from the ground section's `heads_from`) instead of fresh: the heads keep what they learned, and the
    tower does not take a random head's gradients at the phase's start (arpo_core/offline/grounding.py,
    decision "Carried heads"). `true` carries every head the phase trains; a list carries those (each one
    the phase trains), the others start fresh. The previous phase must train each carried head, of the
    same kind; false = fresh heads, as before."""


@dataclass(frozen=True)
class SFTConfig:
    """Behaviour-cloning hyperparameters."""

    def __post_init__(self) -> None:
        if self.point_one_click and not self.point_weight:
            raise ValueError(
                "point_one_click needs point_weight > 0 (it chooses the demos the pointing loss is taught on)"
            )

    steps: Annotated[int, Ge(1)] = 100
    """Optimizer steps."""
    batch_size: Annotated[int, Ge(1)] = 8
    """Trajectories per micro-batch."""
    grad_accum: Annotated[int, Ge(1)] = 1
    """Micro-batches per optimizer step."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3))
    """AdamW (lr, weight decay, clip) and bf16 autocast."""
    warmup_steps: Annotated[int, Ge(0)] = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    min_lr_frac: Annotated[float, Interval(ge=0, le=1)] = 1.0
    """Cosine decay from `optimizer.lr` to `min_lr_frac * optimizer.lr` at the last step (1.0: constant
    after warm-up)."""
    checkpoint_every: Annotated[int, Ge(0)] = 0
    """Save every N optimizer steps (0 = only at the end, and only with a checkpoint_dir)."""
    seed: Annotated[int, Ge(0)] = 0
    """Shuffling seed (and the initialisation of layers added by `grow_after`)."""
    point_weight: Annotated[float, Ge(0)] = 0.0
    """Weight of the pointing loss added to the cloning loss: at the two positions of each demo click that
    predict the first character of x and of y, the first `point_heads` query heads of the language model's
    last layer are taught to attend to the merged image token under the demo's click, on the screen the
    reply answers (arpo_core/offline/behaviour_cloning.py, decision "Pointing loss"): the ground stage's
    pointing loss carried to the demos' instructions, which name several targets in an order; 0 = off,
    the batches and the model as without the field."""
    point_heads: Annotated[int, Ge(1)] = 1
    """How many query heads of the last layer the pointing loss teaches (the first ones; the ground stage's
    phases teach 1, which `policy.click_readout` reads)."""
    point_one_click: bool = False
    """Teach the pointing loss only in demos whose trained replies click once (the instruction names one
    target: "Click on the "ok" button."); a demo that clicks several targets in an order ("Select a, b and
    click Submit") is cloned without it (arpo_core/offline/behaviour_cloning.py, decision "Pointing loss").
    Needs `point_weight` > 0; off = every demo click, as before. Measured over six cloning seeds: level with
    the loss on every demo held out, 3.9 points under it out of domain, and click-checkboxes still falls."""
    grow_after: list[Annotated[int, Ge(0)]] | None = None
    """Before behaviour cloning, insert a new language-model layer after each of these layer indices
    (`policy.model.grow_depth`: the grown model computes the same function until trained), e.g. [0, 1]
    turns the 2-layer grounded tiny policy into 4 layers: more capacity for the replies' text without
    losing its grounding. Applied by the `sft` stage; null: the depth as it is."""


@dataclass(frozen=True)
class DPOConfig:
    """DPO on success-vs-failure pairs of the same task (preference.py, decisions "DPO sigmoid loss" and
    "DPO pairs")."""

    beta: Annotated[float, Gt(0)] = 0.1
    """Inverse temperature of the implicit reward beta * (log pi - log ref) (TRL default 0.1)."""
    label_smoothing: Annotated[float, Interval(ge=0, lt=0.5)] = 0.0
    """cDPO: assumed probability that a preference label is flipped (0 = plain DPO; at 0.5 the labels
    carry no information)."""
    max_pairs_per_task: Annotated[int, Ge(1)] | None = 16
    """Cap on pairs per task (None: max(successes, failures) of the task)."""
    steps: Annotated[int, Ge(1)] = 50
    """Optimizer steps."""
    batch_size: Annotated[int, Ge(1)] = 8
    """Pairs per optimizer step."""
    micro_batch_size: Annotated[int, Ge(1)] = 2
    """Pairs per forward/backward (2x as many sequences); <= batch_size."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """AdamW (TRL's DPO default lr 1e-6 is for 7B models; the tiny policy needs more) and bf16 autocast."""
    seed: Annotated[int, Ge(0)] = 0
    """Seed of pairing and batch order."""

    def cross_checks(self) -> Iterator[tuple[str, str, tuple[str, ...]]]:
        """Rules across fields, checked by the params loader: (field, rule, other fields involved)."""
        if self.micro_batch_size > self.batch_size:
            yield "micro_batch_size", "must be <= batch_size", ("batch_size",)


@dataclass(frozen=True)
class KTOConfig:
    """KTO on desirable (successful) and undesirable (failed) trajectories, unpaired (preference.py,
    decisions "KTO loss" and "KTO class weights")."""

    beta: Annotated[float, Gt(0)] = 0.1
    """Inverse temperature of the implicit reward (TRL default 0.1)."""
    desirable_weight: Annotated[float, Gt(0)] = 1.0
    """lambda_D: weight of the desirable losses."""
    undesirable_weight: Annotated[float, Gt(0)] = 1.0
    """lambda_U: weight of the undesirable losses."""
    balance: bool = True
    """Scale the two weights so lambda_D n_D / (lambda_U n_U) is in [1, 4/3] (TRL's advice)."""
    steps: Annotated[int, Ge(1)] = 50
    """Optimizer steps."""
    batch_size: Annotated[int, Ge(2)] = 8
    """Trajectories per optimizer step (the KL reference point is estimated on this batch; >= 2)."""
    micro_batch_size: Annotated[int, Ge(1)] = 4
    """Trajectories per forward/backward; <= batch_size."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """AdamW and bf16 autocast."""
    seed: Annotated[int, Ge(0)] = 0
    """Seed of KL partners and batch order."""

    def cross_checks(self) -> Iterator[tuple[str, str, tuple[str, ...]]]:
        """Rules across fields, checked by the params loader: (field, rule, other fields involved)."""
        if self.micro_batch_size > self.batch_size:
            yield "micro_batch_size", "must be <= batch_size", ("batch_size",)


@dataclass(frozen=True)
class RFTConfig:
    """Rejection-sampling fine-tuning: SFT on the successful trajectories (preference.py,
    decision "RFT as cloning")."""

    max_per_task: Annotated[int, Ge(1)] | None = 16
    """Keep at most this many successes per task (None: all)."""
    seed: Annotated[int, Ge(0)] = 0
    """Seed of which successes are kept when a task has more than max_per_task."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The behaviour-cloning run on the kept trajectories."""

    def cross_checks(self) -> Iterator[tuple[str, str, tuple[str, ...]]]:
        """Rules across fields, checked by the params loader: (field, rule, other fields involved)."""
        if self.sft.grow_after:
            yield "sft.grow_after", "must be null: RFT fine-tunes the base policy at its own depth", ()


@dataclass(frozen=True)
class ReplayConfig:
    """Experience replay settings (params.yaml `train.replay`)."""

    enabled: bool = True
    """Fill all-failed groups from the buffer. False = plain GRPO (the buffer still records successes)."""
    capacity_per_task: Annotated[int, Ge(1)] = 8
    """Successful trajectories kept per (domain, task id); the oldest is evicted first (paper: 8)."""
    trigger_std: Annotated[float, Gt(0)] = 0.05
    """A group counts as failed when the population std of its signals is below this ..."""
    trigger_mean: Annotated[float, Interval(gt=0, le=1)] = 0.2
    """... and their mean is below this (reference: std < 0.05 and mean < 0.2)."""
    seed: Annotated[int, Ge(0)] = 0
    """Seed of the buffer's own RNG (which stored success is drawn); saved and restored with the buffer."""
    signal: Literal["success", "reward"] = "success"
    """Value compared with the thresholds: the checker score (reference code) or the trained reward."""
    preload: Literal["none", "baseline"] = "none"
    """What the buffer holds before epoch 1: nothing (the reference code, whose json preload is commented
    out), or each trained task's successes among the baseline stage's rollouts (as DART-GUI starts from
    pre-collected successes). Stored by `add`'s rules: successes only, at most capacity_per_task, newest
    kept."""

    def __post_init__(self) -> None:
        check_fields(self)  # the ranges declared above, also for a config built in code


@dataclass(frozen=True)
class SelectConfig:
    """Valuable task selection settings (params.yaml `select`)."""

    min_successes: Annotated[int, Ge(0)] = 1
    """Keep tasks with at least this many successes (paper: 1 of 16)."""
    max_success_rate: Annotated[float, Interval(ge=0, le=1)] | None = None
    """Drop tasks whose success rate exceeds this (None: keep always-solved tasks, as the paper)."""
    max_tasks: Annotated[int, Ge(1)] | None = None
    """Keep at most this many tasks (paper's single-node subset: 32); None keeps all eligible ones."""
    cap_mode: Literal["random", "top"] = "random"
    """How the cap picks: seeded uniform sample, or highest success count first."""
    seed: Annotated[int, Ge(0)] = 0
    """Seed of the cap's random sample."""

    def __post_init__(self) -> None:
        check_fields(self)  # the ranges declared above, also for a config built in code
