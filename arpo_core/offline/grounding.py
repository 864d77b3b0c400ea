"""Grounding pretraining: teach the policy to click where the instruction's target is on the screen.

Behaviour cloning a randomly initialised tiny model learns the reply format but not to look at the
screen (docs/method.md §7): its clicks are image-blind. This module supplies the stage that comes before
BC (docs/design.md stage `ground`): unlimited cheap "where is X" examples, a training loop, and the measures
that say whether clicks follow the image.

Decisions:
- **Grounding example.** An example is one screenshot, an instruction naming one target, and the UI-TARS reply
  `Thought: ...\\nAction: click(start_box='(x,y)')` with (x, y) the target's centre in model-image
  pixels (the smart_resized frame the policy sees, docs/method.md §3). It is trained with exactly the
  sequence layout, prompt and loss of BC and RL (`policy/sequences.py`), so the grounding transfers to
  the task replies unchanged: no special tokens, no extra heads, no change to what the model sees.
- **Two sources.** Two sources: synthetic screens drawn with PIL in MiniWoB's style (160x210, the yellow
  instruction strip on top, coloured boxes, buttons, links, checkboxes with words; `synthetic_examples`), and
  real MiniWoB screens of many tasks where every visible, topmost DOM element with a unique text is a target
  (`miniwob_examples`). Synthetic data costs ~1 ms per screen and needs no browser, so the training
  loop draws fresh screens every step (no overfitting, no dataset on disk).
- **Synthetic curriculum.** A curriculum of synthetic levels (`LEVELS`): one salient box -> a named box among
  distractors -> text widgets -> mixtures. The level of each drawn example comes from `GroundConfig.mix`.
- **Reading curriculum.** Picking the named target among look-alikes is what real MiniWoB screens ask (a
  label read off the screen), and what the first levels did not teach (the named box among 1-3 at chance).
  The reading levels put 2-8 targets on a screen that differ ONLY in what the instruction names: boxes of one
  size in distinct colours, or widgets of one kind in one font size (Pillow's bundled sans at 10-14 px,
  MiniWoB's Arial sizes) with distinct words, scattered or in MiniWoB's column layout (checkboxes, links),
  the named one at a random place in the order. Size, kind, style and position carry no hint, so the only
  way to the target is to read it. A phase advances to the next level on held-out evidence (`until_hit`,
  measured every `eval_every` steps on held-out screens of the phase's own levels, never trained on), with
  `steps` as its most; real MiniWoB screens (`miniwob_examples`) are the last level and the fixed half of
  each batch (a phase with `miniwob_seeds` 0 has whole synthetic batches). Measured (docs/results.md,
  "Colours read with whole synthetic batches"): the colour level with whole synthetic batches turned
  between 2,000 and 3,000 steps and passed its 0.9 gate at 4,000 (boxes8 0.92, box4 0.94 held out), where
  half real batches had ended the level at 0.44; the real screens fell 0.23 -> 0.11 meanwhile.
- **Open vocabulary.** The reading levels draw their words from `WORDS`, 50 common ones, and the reader
  trained on them (assets/checkpoints/grounded-read-xs) learned those 50, not reading: on held-out real
  screens its thought copied the named button's word every time (click hit 0.87), and never the random
  labels of click-checkboxes or the lorem-ipsum phrases of click-button, nor most of click-link's words,
  writing a familiar-looking word instead (hit 0.06-0.16; docs/results.md, "What the reader cannot read").
  The `open*` levels are the reading levels with the words real screens have: random letters and digits
  of 2-7 characters for checkbox labels (`openchecks8`), lorem-ipsum words for links (`openlinks8`) and
  phrases of 1-3 of them for text (`opentexts8`), drawn fresh for every screen, so no fixed set of names
  can be learned in their place and the instruction's characters must be copied and matched. The naming
  loss (a fixed `NAMES` head) skips their words; the spelling loss spells them (decision "Spelling loss").
- **Quoted names.** Continued on the open levels for 8,000 steps, the reader's thought copied a
  lorem-ipsum link's name (a few dozen recurring words) 0.89 of the time but a random label's 0.09
  (held-out openchecks8): the instruction quotes a name ('"vdtCA"', tokens `v d t C A`) where the thought
  writes it after a space (` v d t C A`), so the first token is another token and, as the copy goes on, the
  thought's last token never occurs in the instruction; a copy by lookup (attend to where the current token
  is in the instruction, take the next) has nothing to find. With `quote_names` the training thoughts
  quote the name as the instruction does (`quote_name`: 'I will click the label "vdtCA".'), the same
  tokens in both places. Levels whose instructions do not quote the name (the colours, links8, checks8)
  keep their thoughts. Measured (docs/results.md, "Words never seen"): it bought little copying and no
  clicks, random labels copied 0.09-0.14 at 8,000 steps against the control's 0.09, and 0.30 at 12,000
  against the control's 0.20 at 20,000, their clicks at the control's; the 2-layer language model copies
  names it has seen often (lorem-ipsum links 0.88-1.00 in every arm), not by looking characters up.
- **Spelling loss.** The naming loss taught the tower 50 words (a fixed head, one class per word), and
  fresh words were then picked at chance. A phase may add a spelling loss (`spell_weight`): a linear head
  (a `NameHead` of the phase's own with one output per character) says from the same window of merged
  image tokens which letters (case folded) and digits a look-alike word holds (`spell_targets`), for
  every word of the batch's synthetic screens that fits its window (`spelled`; open words included,
  colours not): a position-free target that a linear map of the window can fit, and that no fixed
  vocabulary satisfies.
  Its held-out measure is the F1 of the characters said (`<set>/spell_f1`). Measured (docs/results.md,
  "Words never seen"; weight 0.2, 12,000 steps): random labels' F1 stayed at 0.02-0.04, and every open
  set's under the best constant answer's (the same letters for every word), and the clicks moved within
  noise.
- **Lorem names.** Reading fresh words did not come (decisions "Quoted names", "Spelling loss"), but the
  words click-link asks for are not fresh: MiniWoB draws its links and paragraphs from one list of 169
  lorem-ipsum words (`ui_utils.lorem_words`), and the naming loss taught the tower the 50 words it was
  given (buttons8 0.95). More real screens taught the thought three in four link words while the click
  stayed at 0.26 (docs/results.md, "More real screens"): the language model had the name, the tower's
  tokens did not tell that word from its neighbours. With `name_vocab: lorem` the naming head has a class
  for each of those words too (`name_vocab`: `NAMES`, then the installed MiniWoB's list, `miniwob_lorem`,
  and `LOREM`, case folded, trailing punctuation dropped; `name_key`), and names them wherever they are a
  look-alike: on real screens, whose every unique-text element is listed in `named`, and on the open
  levels' one-word links and texts. The fixed vocabulary names synthetic screens only, as before, so a
  `fixed` phase trains and measures what it did. Random labels are in no list and stay unnamed.
  Real screens alone are too few to name words from: click-link lists about four unique links a screen,
  and the head learned the 600 training screens instead (their links named 0.86 after 4,430 steps,
  held-out screens' 0.10). Two levels draw fresh screens of the same words: `lorem8`, the scattered or
  column links of the reading levels in MiniWoB's words (`open_words` style 'miniwob'), and `paralinks`,
  click-link's own screen (`_level_paragraph`: a paragraph of 20 words as `generateWords` writes them,
  each a link with probability 0.2, in the font the project's Chromium draws MiniWoB's Arial in,
  `chromium_font`, laid out from the task area's corner in 11 px lines as the browser lays it out).
  Measured (docs/results.md, "Lorem names"; ground-reading-real's recipe, one seed): with `lorem8` a third
  of the synthetic screens the head named held-out `lorem8` links 0.41 and real links 0.17 after 10,000
  steps, the clicks did not follow (`lorem8` 0.23 from 0.20; real targets 0.39 against the control's
  0.44); with `paralinks` it named held-out paragraph links 0.12 after 7,000 steps. None is in a recipe.
- **Reading aloud.** A click among look-alikes says whether the model read the screen only through a few
  coordinate digits per example, and a wrong pick and a blurred point look alike in them (the 2-layer
  reading run's misses on held-out boxes8: 12 of 64 clicks on another box, 24 between boxes). With
  `read_aloud` a synthetic reply's thought first names every look-alike in reading order, then the
  target (`read_aloud`): each colour or word on the screen becomes a supervised token, as a VLM learns
  to read from transcripts, while the screen, the instruction and the action stay the same. What the
  policy is asked at inference does not change; its greedy reply is longer (an 8-word screen: 44 tokens
  with the tiny tokenizer, under `policy.max_new_tokens` 64). Real MiniWoB screens keep their thought.
  Measured, and not to be used for clicks: `presets/ground-reading-aloud.yaml` against its control
  `ground-reading-2l` at the end of the colour level (4,000 steps, the same screens): box1h 0.55 vs 0.97,
  box4 0.05 vs 0.44, boxes8 0.03 vs 0.27 (the held-out hit rates); decision "Reading examples" says why
  and what replaced it. The option stays so that the measurement re-runs.
- **Reading examples.** Reading aloud before the click broke the click (measured: the 2-layer base's
  held-out box1h hit rate fell from 0.95 to 0.11 in 1,000 steps, box4 to 0.06): the tiny policy reads a
  target's position through relative rotary positions between the coordinate tokens and the image, and a
  thought whose length varies with the screen moves those tokens. So reading is taught by examples of
  its own instead (`read_share` of a phase's synthetic screens): the same screen asks "Read the buttons
  from top to bottom." and the reply answers `finished(content='next, back, ok')`, every look-alike's
  colour or word in reading order, while the click examples keep their short thought. The embeddings are
  tied, so reading pulls a patch's features toward the very word embedding the click's instruction
  carries. Held-out reading sets (`read-<level>`, the click set's screens) are scored by `read_score`.
- **Naming loss.** The reading levels' clicks picked the named word at chance, and a probe of the
  merged image tokens found no word in them (benchmarks/word_probe.py): the vision tower never built
  glyph features, which a click among look-alikes supervises only through a few coordinate digits. A
  phase may add a naming loss (`name_weight`): a linear head (`NameHead`, the phase's own, kept in its
  checkpoint and dropped at the end, so the saved policy stays a stock Qwen2.5-VL) names every look-alike
  of the batch's synthetic screens, its colour ("red box") or word (`NAMES`), from the merged image tokens
  in a fixed screen window around it (`name_window`, `window_tokens`: the tokens the language model gets);
  `vision_lr_scale` gives the tower a learning rate of its own; `name_only` trains the naming loss alone
  (the tower and the head; history "loss" is then the naming loss), a tower's word phase before the click
  levels. The curves add the head's held-out accuracy (`<set>/name_acc`). Measured (docs/results.md, "A naming loss for the vision tower"): the head
  names colours at 0.98-1.0 within 1,000 steps but words at only 0.1-0.25 after the word level's 8,000
  steps, too little to move the word clicks, and the colour clicks lost to it (box4 0.30 against the
  control's 0.44 after the colour level); trained alone (`name_only`, 30,000 steps) the tower's tokens
  name held-out words at 0.63-0.83, while the clicks that read the old tokens fall to near zero until
  the click levels retrain them. Taught words alone, a fresh tower at lr 1e-3 without warm-up
  stays at the chance loss, at 3e-4 it learns, and a small conv net on the same pixels learns at once:
  the 14-px patch grid, not the pixels, makes words slow for a tiny tower. Yet the click levels after
  that naming phase picked the words no better than the control, and half of the words left the tokens
  (a probe: 0.06 -> 0.23 -> 0.13); with the naming loss kept beside the clicks the head still named
  held-out buttons at 0.8-0.9 and the named button was still clicked at chance: the 2-layer language
  model, not the tower, is what does not find the word. `name_tied` ties the head to the language model
  (`TiedNameHead`: a window token scores its cosine with the model's own embedding of the word, nothing
  learned between the spaces), so that a click could find the word by one match instead of one
  association per word; measured, it taught the tower the words (0.47 on buttons in 10,000 steps) but
  kept beside the clicks it broke them (box1h 0.00-0.05 through the colour level). `name_token` names a
  look-alike from its best single token instead (`TokenNameHead`: one linear map of each merged token whose
  centre lies in the look-alike's box, the highest logit per name): the window head may spread a word over
  its tokens, and a pointing head attends token by token. A probe of the 2x lorem reader found exactly that
  spread (benchmarks/match_probe.py, `token_name`): where the last layer reads them, the look-alikes'
  tokens name their word together (their mean) 0.55-0.64 among a screen's words and one by one 0.33-0.39
  (lorem, fixed and button words; at the tower's output 0.66-0.87 and 0.39-0.45). Measured (docs/results.md,
  "A second screen: four levers on the screen's side"): in 2,000 steps branched from the 2x lorem reader
  the one-token head named the fixed words 0.17-0.28 and the lorem words 0.04, no faster with a grown
  tower block, and neither the tokens (that probe, at the tower's output) nor the clicks moved.
- **Pointing loss.** With the words in the tokens, the picks stayed at chance (decision "Naming loss"):
  the language model did not learn, from a few coordinate digits per example, to find the image token
  that matches the instruction's word. A phase may supervise that retrieval directly (`point_weight`, as
  GUI-Actor trains an action token's attention on the target's patches, here on stock heads so the policy
  stays a stock checkpoint): at the positions that predict the click's coordinates (`point_spans`), the
  first `point_heads` query heads of the last decoder layer are taught to put their attention on the
  merged image tokens under the target (-log of the mass there, in log space so that a head that starts
  far away still gets a gradient). Only the last layer can match: its query has read the instruction in
  the layer before. The weights are the layer's own, recomputed in fp32 from its inputs (policy/heads.py),
  so the loss does not depend on the attention kernel (a test checks them against eager attention, both
  families). The curves add the heads' held-out mass on the target (`<set>/point_mass`), on the other
  look-alikes (`point_other`) and its chance level (`point_even`, the target's share of the look-alikes'
  tokens) and the hit rate of the clicks read off head 0 (`<set>/cell_hit`, policy/heads.py, decision
  "Clicks read from the pointing head"). Measured (docs/results.md, "Pointing at the named target"): on
  colours the head's mass on the named box passed 0.7 in 1,000 steps and the clicks turned sooner
  (boxes8 0.80 against 0.61 at 2,000 steps); on words the head found the look-alikes at once and leaned
  to the named one at about twice chance (buttons8 0.65 against an even 0.30 after 8,000 steps), while
  the clicks stayed near chance.
  After the tower's naming phase, at weight 1.0 the head put all its mass on the named box among eight
  (1.00) while the clicks stayed at zero: what is left is reading the pointed token's place, not finding it.
- **Place loss.** A head that attends to one image token reads what the token carries, and Qwen2.5-VL
  gives the image tokens rotary positions only, which change how tokens attend, not what they carry; the
  vision tower has no absolute position either. So the pointed token's place reaches the click only if a
  layer wrote it into the token. A ridge probe (benchmarks/place_probe.py) finds the column barely there:
  held-out R^2 0.20 where the last layer of grounded-xs reads the tokens, 0.02 after the tower's naming
  phase (the row, which the instruction strip and the layout give, 0.73 and 0.52). A phase may teach it
  (`place_weight`): a linear probe of its own (`PlaceProbe`, in the phase's checkpoint and then discarded,
  so the policy stays a stock checkpoint) reads each merged image token's row and column on the grid
  (`place_targets`, in [-1, 1]) from its hidden state where the last decoder layer's attention reads it
  (after that layer's input norm; the `_PointCapture` hook), and the mean squared error is added to the
  loss, so the layers before learn to write the place (the language model's first layers can: an image
  token attends to the prompt's text tokens with a rotary score that depends on its row and column). The
  curves add the probe's held-out R^2 (`<set>/place_row`, `<set>/place_col`). Measured (docs/results.md,
  "Where the pointed token is"): the column reached R^2 0.99 within 1,000 steps (the tower's output stays
  at 0.10: the language model's first layer writes it); after the naming phase, with pointing at 1.0, the
  colour clicks that had stayed at zero came back (boxes8 0.33 against 0.03 at 4,000 steps, 0.72 at
  6,000), at pointing 0.1 they came sooner (0.77 against 0.48 at 4,000), and in the word level the named
  button among up to eight was clicked at 0.72 after 8,000 steps (blind 0.14). A cell's place cannot tell
  apart rows closer than a cell (checkbox columns: rows 13-22 screen px apart, cells of 28 model px),
  which may be why checks8 rises last.
- **Image dependence metrics.** Image dependence is measured on held-out screens with greedy decoding: mean
  pixel error, hit rate (click inside the target box), Pearson correlation of predicted vs target x and y, the
  spread of the clicks, and the image-blind ceiling (the best constant click for the same screens).
  docs/method.md §7: a success rate alone proves nothing here.
- **Real targets by kind.** One real-screen hit rate mixes targets no in-domain task asks for (click-button's
  paragraph phrases, the majority of its targets) with the ones they do ask for (buttons, links, checkbox
  labels), and these fail for different reasons. So the real screens' hits are also kept per task and
  element kind (`hits_by_target`, `<task>/<kind>`, e.g. `click-link/link`), beside the one rate.
- **Library training loop.** Library code: the training loop returns its history (loss per step, evaluations)
  and logs nothing. The prompt (system prompt name) and the greedy reply length of its evaluations are
  required arguments, not config fields with defaults: params' `policy` section holds them for every stage.
- **Rotary frequencies.** What makes looking learnable (benchmarks/results/grounding.md): the LM's rotary
  frequencies. Qwen2.5-VL splits head_dim / 2 rotary frequencies into contiguous (t, h, w) bands, highest
  first; at the stock theta 1e6 a tiny head's w band turns < 2e-4 rad per image token and the h band < 0.03,
  so relative attention cannot tell image columns (and barely rows) apart and absolute position has to come
  from slow side channels. Building the tiny model with `rope_theta=5` (all bands 0.2-1 rad per token, still a
  stock Qwen2.5-VL config value; `build_tiny_policy(rope_theta=..., mrope=...)`) made greedy clicks
  follow a single target after ~1k steps of the xs model, where theta 1e6 stayed image-blind. Every image
  token of a screenshot has one t position, so only the t band (the highest frequencies, 2 of the xs
  split's 16 pairs) lets a later token match image content wherever it is; a split with a wider t band
  ([8, 4, 4], `policy.model.resplit_mrope`) was measured on the trained base and bought nothing (colours
  0.92 vs 0.97, words equal; docs/results.md, "Colours read with whole synthetic batches"). A coordinate
  code blended into the pixels (`coord_pattern`, `GroundConfig.pattern`) was tried as well;
  it is off by default and would have to become part of the saved image processor to be used.
- **Resumable training.** Given a checkpoint file, the loop saves everything the next step depends on (step,
  weights, AdamW and schedule states, the example stream's RNG and the fixed list's pending order, torch's
  RNG, the history) atomically every `checkpoint_every_s` seconds and at the end, and a call with the same
  file and config continues from it: a run killed at any point and restarted trains the same weights and
  loss curve as one that never stopped (a test kills one mid-run). A file made under another config is an
  error naming both, never silently resumed; a finished file returns at once, so a multi-phase caller (the
  ground stage) resumes phase by phase.
- **Carried heads.** The naming head, spelling head and place probe are a phase's own, in its checkpoint.
  Each phase started fresh ones: measured on the 2x reader (docs/results.md, "The reader at 2x visual
  resolution"), the head that named the words 0.8 at the end of phase 0 named nothing at phase 1's step 0,
  and until the new one learned, the tower was taught by a random head's gradients. With `carry_heads` a
  fresh phase loads them from the previous phase's checkpoint (`heads_from`; the ground stage passes
  `phase-<i-1>.pt`, or for the first phase the section's `heads_from`, another run's checkpoint file, so
  that a run branched from another's snapshot keeps its heads); the optimizer's state for them starts
  fresh, as for the model. A resumed phase loads its own checkpoint instead. A head the file lacks or that
  does not fit (another vocabulary, another window) is an error naming the file and the head, never a
  silent fresh start; a phase that adds a head the previous one did not train lists the heads it carries
  (`carry_heads: [head, probe]`), and the rest start fresh by its own word.
- **Match loss.** On the 2x lorem reader (stage step 7,000) a linear probe of the states the last layer
  reads finds the named lorem-ipsum word both at the query (the position that predicts x's first
  character: the target's class among the screen's look-alikes 0.88) and in the look-alikes' tokens (0.55),
  and a match through those two probes picks the named link 0.46, where the pointing head picks it 0.27
  (chance 0.24); on the fixed words' links the head is near its probes' match (0.55 against 0.65;
  benchmarks/match_probe.py, docs/results.md "Where the named word is"). So the words are there and the
  head's query-key map has not aligned them: one alignment per word, which the 50 fixed words (41 of
  them one token of the tiny tokenizer) got from long training and MiniWoB's 169 lorem-ipsum words (2-8
  tokens each, and far fewer clicks per word in this run) have not. With `match_weight` one linear head
  (`MatchHead`, the phase's own, dropped at the end) names, from the last layer's attention inputs, both
  the target's word at the two first-digit query positions and each named look-alike's word from its
  tokens' mean (`match_items`, names by `name_key` under the phase's `name_vocab`; cross-entropy, the two
  sides averaged): the query and the keys are taught to carry a word the same way, so one alignment (the
  head's map between that shared form) serves every word. A fresh head's gradient is a random direction
  (measured in the first screen: at weight 1.0 from a fresh head its loss fell 5.5 -> 4.8 in 500 steps and
  the colour clicks fell with it, box4 0.88 -> 0.66), so a phase may train the head alone first
  (`match_warmup` steps, the states detached) and at a rate of its own (`match_lr_scale`); its gradient
  norm is clipped apart from the model's, so that in the warm-up the model steps as without the loss.
  Measured (docs/results.md, "A short screen of the match loss"; 2,000 steps branched from the 2x lorem
  reader at stage step 8,286, beside a control): with the warm-up the head learned the query side at once
  (held-out lorem words 0.75, the fixed ones 1.00) and the key side hardly (0.31-0.40), the named lorem
  link stayed at blind (0.17 against the control's 0.20) and the written clicks lost (buttons8 0.33,
  real 0.39 against 0.52 and 0.43). Off by default; no recipe uses it. The curves add what the head reads
  (`match_picks`): `<set>/match_query`, `<set>/match_key` and `<set>/match_pick`, each a pick among the
  screen's named look-alikes.
- **Grown layers' rate.** A layer or vision block a phase grows (`grow_after`, `grow_vision_after`) starts
  with zero output projections, so its first gradients are those of a layer that writes nothing: measured
  on the 2x lorem reader (docs/results.md, "A second screen: four levers on the screen's side"), a grown
  decoder layer reached output-projection norms of 1.7-1.9 and a grown tower block 3.8-4.6 in 2,000 steps
  at lr 5e-4, where the trained ones' are 17-64, and every measure stayed the control's. With
  `grown_lr_scale` the grown parameters (the stage names them: `policy.model.grown_prefixes`) form
  groups of their own at their part's rate times it (the tower's includes `vision_lr_scale`); the
  gradient-norm clip still spans every parameter. Without it the optimizer's groups are those of the
  runs before the field, so their checkpoints resume. A tower widened by a phase (`widen_vision_to`,
  `policy.model.widen_vision`) has its new channels inside the old parameters (more rows and columns of
  the same matrices), so they take the tower's rate (`vision_lr_scale`), not this one. Measured
  (docs/results.md, "Grown parts at a rate of their own"; 2,000 steps, the same branch): at 10x the grown
  layer's and block's norms reached 8-21 (1.7-4.6 at the part's rate), and no held-out measure moved off
  the control's, nor what a single image token carries; off by default, in no recipe.
- **First digits.** The pointing loss and its curve (`point_mass`) take every position that predicts a
  character of the click's coordinates. Teacher-forced, all but two of them have read the right digits
  before them, so a head can sit on the target there without having found it; only the positions before
  the first character of x and of y decide where the click goes, and x's first is the one that has read
  no digit. On the 2x reader's held-out buttons the mean mass was 0.92, at x's first character 0.73 and
  at y's 0.95 (the 1x reader: 0.98, 0.91, 0.99; benchmarks/point_positions.py). So the curves add
  `<set>/point_first`, the mass at those two positions (their mean), and a phase may teach the loss there
  alone (`point_first`), giving the decisive positions the whole weight instead of about two sevenths of
  it. Measured (docs/results.md, "Short screens on the 2x reader"): taught alone for 2,000 steps from the
  2x reader, the first digits' mass stayed where it started (buttons8 0.79, widget4 0.77) and the clicks
  with it; there the head mostly has the named widget and the click misses it, so the option stays off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
import string
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from arpo_core.actions import ActionParseError, parse_response
from arpo_core.config.sections import TRAINED_HEADS, GroundTrainConfig
from arpo_core.infra.fileio import atomic_open
from arpo_core.offline.behaviour_cloning import lr_factor
from arpo_core.policy.heads import (
    AttentionInputs,
    HeadWeights,
    Pointed,
    cell_size,
    click_positions,
    image_cells,
    pointed,
)
from arpo_core.policy.model import Policy
from arpo_core.policy.prompt import PromptInput, PromptSpec, build_segments, model_image_size
from arpo_core.policy.sequences import EncodedSequence, collate, encode_segments, sequence_logprobs
from arpo_core.trajectory import Step, Trajectory, png_bytes

__all__ = [
    "LEVELS",
    "AttentionInputs",
    "GroundConfig",
    "GroundExample",
    "GroundMetrics",
    "MatchHead",
    "MatchItems",
    "PlaceProbe",
    "TokenNameHead",
    "best_constant_click",
    "box_tokens",
    "checkpoint_fingerprint",
    "click_reply",
    "coord_pattern",
    "coordinate_nll",
    "element_kind",
    "evaluate_grounding",
    "evaluate_reading",
    "first_click",
    "greedy_replies",
    "grounding_metrics",
    "image_cells",
    "image_dependence",
    "lr_factor",
    "make_grounding_examples",
    "match_items",
    "match_picks",
    "miniwob_examples",
    "pearson",
    "place_targets",
    "point_spans",
    "read_aloud",
    "read_score",
    "synthetic_example",
    "synthetic_examples",
    "to_trajectory",
    "train_grounding",
]

SCREEN_W, SCREEN_H = 160, 210
"""MiniWoB's task area in screen pixels."""
HEADER_H = 50
"""Height of MiniWoB's yellow instruction strip (#query) at the top of the task area."""

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (20, 170, 40),
    "blue": (30, 60, 230),
    "yellow": (240, 220, 20),
    "orange": (250, 140, 0),
    "purple": (140, 40, 180),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "pink": (250, 120, 200),
    "cyan": (0, 200, 220),
}
"""Named colours of synthetic boxes (MiniWoB click-color uses similar plain colours)."""

WORDS = (
    "ok submit cancel yes no next back home about login search save open close apple banana cherry "
    "delta echo golf hotel india kilo lima mike oscar papa romeo sierra tango victor zulu alpha bravo "
    "one two three four five left right top bottom red green blue"
).split()
"""Words on synthetic widgets."""


@dataclass(frozen=True)
class GroundExample:
    """One grounding example; coordinates in model-image pixels (decision "Grounding example")."""

    image: Image.Image
    """The screenshot as the env returns it (screen pixels, e.g. 160x210)."""
    instruction: str
    """Names exactly one target, e.g. 'Click the red box.'."""
    target: tuple[float, float]
    """Centre of the target, model-image pixels."""
    bbox: tuple[float, float, float, float]
    """Target box (x0, y0, x1, y1), model-image pixels."""
    source: str
    """'synthetic/<level>' or 'miniwob/<task>'."""
    thought: str = ""
    """Thought of the reply (names the target)."""
    lookalikes: tuple[tuple[float, float, float, float], ...] = ()
    """The boxes of the screen's other targets (model pixels): a click inside one is a wrong pick, not a
    blurred point (`GroundMetrics.other_hit_rate`)."""
    answer: str | None = None
    """A reading example's answer (decision "Reading examples"): the reply is `finished(content=answer)`,
    not a click; `target` and `bbox` are then the first item read."""
    named: tuple[tuple[tuple[float, float, float, float], str], ...] = ()
    """A screen's every look-alike, the target included, as (box in model pixels, its colour ("red box")
    or word; on a real screen every unique-text element and its text): what the naming loss names where
    `name_key` gives it a name (decision "Naming loss"; real screens only with `name_vocab: lorem`,
    decision "Lorem names"), and the spelling loss spells on synthetic screens where it is a word
    (decision "Spelling loss")."""
    kind: str = ""
    """A real screen's target kind as its instruction names it (`element_kind`: button, link, label,
    text); empty on synthetic screens (decision "Real targets by kind")."""

    @property
    def synthetic(self) -> bool:
        """Drawn by `synthetic_example`, not a real MiniWoB screen."""
        return self.source.startswith("synthetic/")

    @property
    def reply(self) -> str:
        if self.answer is not None:
            return f"Thought: {self.thought}\nAction: finished(content='{self.answer}')"
        return click_reply(self.thought, self.target)


def click_reply(thought: str, point: tuple[float, float]) -> str:
    """The UI-TARS reply clicking `point` (rounded to integer model pixels).

    >>> click_reply("I click the box.", (12.4, 99.6))
    "Thought: I click the box.\\nAction: click(start_box='(12,100)')"
    """
    return f"Thought: {thought}\nAction: click(start_box='({round(point[0])},{round(point[1])})')"


def _scale(screen: tuple[int, int], model: tuple[int, int]) -> tuple[float, float]:
    return model[0] / screen[0], model[1] / screen[1]


def _to_model_box(
    box: tuple[float, float, float, float], sx: float, sy: float
) -> tuple[tuple[float, float], tuple[float, float, float, float]]:
    """Screen box (x0, y0, x1, y1) -> (centre, box) in model pixels."""
    x0, y0, x1, y1 = box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy
    return ((x0 + x1) / 2, (y0 + y1) / 2), (x0, y0, x1, y1)


# ----------------------------------------------------------------------------------------------------
# Synthetic screens (decisions "Two sources" and "Synthetic curriculum")

_FONT = ImageFont.load_default()


def _header(draw: ImageDraw.ImageDraw, text: str) -> None:
    """MiniWoB's yellow instruction strip with the instruction text (the policy also gets it as text)."""
    draw.rectangle((0, 0, SCREEN_W - 1, HEADER_H - 1), fill=(255, 255, 0))
    words, line, y = text.split(), "", 3
    for w in words:  # naive word wrap at ~25 characters
        if len(line) + len(w) + 1 > 25:
            draw.text((3, y), line, fill=(0, 0, 0), font=_FONT)
            line, y = w, y + 11
        else:
            line = f"{line} {w}".strip()
    draw.text((3, y), line, fill=(0, 0, 0), font=_FONT)


def _free_box(rng: random.Random, w: int, h: int, taken: list[tuple], top: int) -> tuple[int, int, int, int]:
    """A (x0, y0, x1, y1) box of size w x h in the task area below `top`, not overlapping `taken`."""
    for _ in range(200):
        x0 = rng.randint(2, SCREEN_W - w - 2)
        y0 = rng.randint(top + 2, SCREEN_H - h - 2)
        b = (x0, y0, x0 + w, y0 + h)
        if all(b[2] + 2 < t[0] or t[2] + 2 < b[0] or b[3] + 2 < t[1] or t[3] + 2 < b[1] for t in taken):
            return b
    raise RuntimeError("no free space for another widget")


def _level_box(
    rng: random.Random,
    draw: ImageDraw.ImageDraw,
    n_distract: int,
    header: bool,
    size: tuple[int, int] = (16, 34),
):
    """Coloured squares (side in `size`, px); the target is named by colour; distractors have other colours."""
    names = rng.sample(sorted(COLORS), 1 + n_distract)
    taken: list[tuple] = []
    top = HEADER_H if header else 0
    boxes = []
    for name in names:
        s = rng.randint(*size)
        b = _free_box(rng, s, s, taken, top)
        taken.append(b)
        boxes.append(b)
        draw.rectangle(b, fill=COLORS[name])
    instr = f"Click the {names[0]} box."
    return instr, boxes[0], f"I will click the {names[0]} box.", list(zip(boxes, names, strict=True))


def _widget(rng: random.Random, draw: ImageDraw.ImageDraw, kind: str, word: str, taken: list, top: int):
    tw = int(draw.textlength(word, font=_FONT))
    if kind == "button":
        w, h = tw + 14, 20
        b = _free_box(rng, w, h, taken, top)
        draw.rectangle(b, fill=(239, 239, 239), outline=(118, 118, 118))
        draw.text((b[0] + 7, b[1] + 5), word, fill=(0, 0, 0), font=_FONT)
    elif kind == "link":
        w, h = tw + 2, 12
        b = _free_box(rng, w, h, taken, top)
        draw.text((b[0] + 1, b[1] + 1), word, fill=(0, 0, 238), font=_FONT)
        draw.line((b[0] + 1, b[3] - 1, b[2] - 1, b[3] - 1), fill=(0, 0, 238))
    else:  # checkbox with its label; the target is the box itself
        w, h = tw + 18, 13
        b = _free_box(rng, w, h, taken, top)
        draw.rectangle((b[0] + 1, b[1] + 1, b[0] + 11, b[1] + 11), fill=(255, 255, 255), outline=(80, 80, 80))
        draw.text((b[0] + 16, b[1] + 1), word, fill=(0, 0, 0), font=_FONT)
        taken.append(b)
        return (b[0] + 1, b[1] + 1, b[0] + 12, b[1] + 12)
    taken.append(b)
    return b


def _level_widgets(rng: random.Random, draw: ImageDraw.ImageDraw, n_distract: int, header: bool):
    """Buttons, links and checkboxes with words; the target is named by its word and kind."""
    words = rng.sample(WORDS, 1 + n_distract)
    kinds = [rng.choice(("button", "link", "checkbox")) for _ in words]
    taken: list[tuple] = []
    top = HEADER_H if header else 0
    boxes = [_widget(rng, draw, k, w, taken, top) for k, w in zip(kinds, words, strict=True)]
    kind, word = kinds[0], words[0]
    instr = {
        "button": f'Click on the "{word}" button.',
        "link": f"Click on the link {word}.",
        "checkbox": f"Check the {word} checkbox.",
    }[kind]
    return instr, boxes[0], f"I will click the {kind} {word}.", list(zip(boxes, words, strict=True))


def _font(size: int):
    """Pillow's bundled FreeType sans (Aileron) at `size` px, MiniWoB's 10-14 px Arial range (decision
    "Reading curriculum"); the bitmap default where Pillow has no FreeType."""
    try:
        return ImageFont.load_default(size=size)
    except (ImportError, OSError, TypeError):
        return _FONT


def _lookalike_widget(draw, kind: str, word: str, font, b: tuple[int, int, int, int]):
    """Draw one look-alike widget of `kind` filling screen box `b`; returns the target box."""
    if kind == "button":
        draw.rectangle(b, fill=(239, 239, 239), outline=(118, 118, 118))
        draw.text((b[0] + 6, b[1] + 3), word, fill=(0, 0, 0), font=font)
        return b
    if kind == "link":
        draw.text((b[0] + 1, b[1]), word, fill=(0, 0, 238), font=font)
        draw.line((b[0] + 1, b[3] - 1, b[2] - 1, b[3] - 1), fill=(0, 0, 238))
        return b
    if kind == "text":
        draw.text((b[0] + 1, b[1]), word, fill=(0, 0, 0), font=font)
        return b
    side = b[3] - b[1]  # checkbox: the square at the left, its label to the right; the target is the square
    draw.rectangle((b[0], b[1], b[0] + side - 1, b[1] + side - 1), fill=(255, 255, 255), outline=(80, 80, 80))
    draw.text((b[0] + side + 4, b[1] - 1), word, fill=(0, 0, 0), font=font)
    return (b[0], b[1], b[0] + side - 1, b[1] + side - 1)


_INSTRUCTIONS = {
    "button": ('Click on the "{w}" button.', "I will click the button {w}."),
    "link": ("Click on the link {w}.", "I will click the link {w}."),
    "text": ('Click on the "{w}" text.', "I will click the text {w}."),
    "checkbox": ("Check the {w} checkbox.", "I will click the checkbox {w}."),
}


LOREM = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et "
    "dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip ex ea "
    "commodo consequat duis aute irure in reprehenderit voluptate velit esse cillum eu fugiat nulla pariatur "
    "excepteur sint occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim id est "
    "laborum quisque massa praesent pharetra porta neque auctor molestie tincidunt faucibus ac congue "
    "dignissim ligula laoreet volutpat posuere hendrerit a tellus vitae nunc eget arcu odio morbi tristique"
).split()
"""Lorem-ipsum words, the text MiniWoB's links and paragraphs are made of (decision "Open vocabulary")."""

_LABEL_CHARS = string.ascii_letters + string.digits


def open_words(rng: random.Random, n: int, style: str) -> list[str]:
    """`n` distinct words drawn fresh (decision "Open vocabulary"): 'label', 2-7 random letters and digits
    (click-checkboxes' labels); 'lorem', a lorem-ipsum word, capitalised or ending in a full stop now and
    then (click-link's); 'phrase', 1-3 of those words (click-button's paragraph text); 'miniwob', a word of
    the installed MiniWoB's own lorem-ipsum list (`miniwob_lorem`), ending in a comma now and then, as
    click-link writes its links (decision "Lorem names")."""
    out: list[str] = []
    while len(out) < n:
        if style == "label":
            w = "".join(rng.choice(_LABEL_CHARS) for _ in range(rng.randint(2, 7)))
        elif style == "miniwob":
            w = rng.choice(miniwob_lorem()) + ("," if rng.random() < 0.15 else "")
        else:
            k = rng.randint(1, 3) if style == "phrase" else 1
            w = " ".join(rng.sample(LOREM, k))
            if rng.random() < 0.25:
                w = w[0].upper() + w[1:]
            if rng.random() < 0.25:
                w += rng.choice(".,:")
        if w.lower() not in {o.lower() for o in out}:
            out.append(w)
    return out


CHROMIUM_FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
"""The font the project's Chromium draws MiniWoB's `font-family: Arial` in (fonts-dejavu-core, which
scripts/setup.sh installs): measured, click-link's 10 px link "Pharetra" is 42.70 px wide in the browser and
in this font."""


@functools.cache
def chromium_font(size: int):
    """`CHROMIUM_FONT` at `size` px (decision "Lorem names")."""
    if not CHROMIUM_FONT.exists():
        raise RuntimeError(f"chromium_font: {CHROMIUM_FONT} is missing (apt-get install fonts-dejavu-core)")
    return ImageFont.truetype(str(CHROMIUM_FONT), size)


def _level_paragraph(rng: random.Random, draw: ImageDraw.ImageDraw):
    """click-link's screen (decision "Lorem names"): a paragraph of 20 of MiniWoB's lorem-ipsum words as its
    `generateWords` writes them (a capital after each full stop, a full stop after a fifth of the words),
    each word a link with probability 0.2, in 10 px Arial as Chromium draws it (`chromium_font`), wrapped
    in the task area from its corner (2, 52) in lines of 11 px; links whose text occurs once are the
    look-alikes, one of them named (at least two: else it draws again). Returns (instruction, the named
    link's screen box, thought, seen)."""
    font = chromium_font(10)
    space, line_h = draw.textlength(" ", font=font), 11
    while True:
        words, first = [], True
        for i in range(20):
            w = rng.choice(miniwob_lorem())
            w = w[0].upper() + w[1:] if first else w
            first = rng.random() < 0.2 and i < 19
            words.append(w + "." if first or i == 19 else w)
        links = [rng.random() < 0.2 for _ in words]
        counts = Counter(w.lower() for w in words)
        if sum(link and counts[w.lower()] == 1 for w, link in zip(words, links, strict=True)) >= 2:
            break
    x, y, seen = 2.0, HEADER_H + 2, []
    for w, link in zip(words, links, strict=True):
        width = draw.textlength(w, font=font)
        if x + width > SCREEN_W - 2 and x > 2:
            x, y = 2.0, y + line_h
        draw.text((x, y), w, fill=(0, 0, 255) if link else (0, 0, 0), font=font)
        if link:
            box = (math.floor(x), y, math.ceil(x + width), y + line_h)
            draw.line((box[0], y + 10, box[2], y + 10), fill=(0, 0, 255))
            if counts[w.lower()] == 1:
                seen.append((box, w))
        x += width + space
    named = rng.randrange(len(seen))
    seen.insert(0, seen.pop(named))
    w = seen[0][1]
    return f'Click on the "{w}" link.', seen[0][0], f"I will click the link {w}.", seen


def _level_lookalikes(
    rng: random.Random, draw: ImageDraw.ImageDraw, kind: str, n_max: int = 8, vocab: str | None = None
):
    """2..n_max targets that differ only in the named attribute (decision "Reading curriculum"): boxes of one
    size in distinct colours, or widgets of one kind and one font size with distinct words, scattered (boxes,
    buttons, links, text) or in MiniWoB's column layout (checkboxes, `kind` 'checks'; links too, half the
    time) with the named one at a random row. `vocab`: an `open_words` style instead of `WORDS` (decision
    "Open vocabulary"). Returns (instruction, the named one's screen box, thought)."""
    n = rng.randint(2, n_max)
    top = HEADER_H
    if kind == "boxes":
        names = rng.sample(sorted(COLORS), n)
        side = rng.randint(14, 30)
        taken: list[tuple] = []
        boxes = []
        for name in names:
            try:
                b = _free_box(rng, side, side, taken, top)
            except RuntimeError:
                break  # no room for more look-alikes
            taken.append(b)
            boxes.append(b)
            draw.rectangle(b, fill=COLORS[name])
        seen = list(zip(boxes, names, strict=False))
        return f"Click the {names[0]} box.", boxes[0], f"I will click the {names[0]} box.", seen
    font_px = rng.randint(10, 14)
    font = _font(font_px)
    words = open_words(rng, n, vocab) if vocab else rng.sample(WORDS, n)
    widths = [math.ceil(draw.textlength(w, font=font)) for w in words]
    while vocab and max(widths) > SCREEN_W - 24:  # a phrase wider than the screen: draw them again
        words = open_words(rng, n, vocab)
        widths = [math.ceil(draw.textlength(w, font=font)) for w in words]
    column = kind == "checks" or (kind == "link" and rng.random() < 0.5)
    widget = "checkbox" if kind == "checks" else kind
    targets = []
    if column:  # one item per row, left-aligned, as click-checkboxes and click-link lay them out
        x0, y = rng.randint(2, 30), top + rng.randint(3, 12)
        row = font_px + rng.randint(3, 8)
        rows = min(n, (SCREEN_H - 3 - font_px - y) // row + 1)
        words, widths = words[:rows], widths[:rows]
        named = rng.randrange(rows)  # the named row is anywhere in the column, not always the first
        words.insert(0, words.pop(named))
        widths.insert(0, widths.pop(named))
        for i in [*range(1, named + 1), 0, *range(named + 1, rows)]:
            h = font_px if widget == "checkbox" else font_px + 2
            width = (font_px + 4 + widths[i]) if widget == "checkbox" else widths[i] + 2
            b = (x0, y, min(x0 + width, SCREEN_W - 2), y + h)
            targets.append((i, _lookalike_widget(draw, widget, words[i], font, b)))
            y += row
        targets = [box for _, box in sorted(targets)]
    else:
        taken = []
        for w, tw in zip(words, widths, strict=True):
            bw, bh = (tw + 12, font_px + 8) if widget == "button" else (tw + 2, font_px + 2)
            try:  # the named one goes first, onto an empty area: only a look-alike can find no room
                b = _free_box(rng, bw, bh, taken, top)
            except RuntimeError:
                break
            taken.append(b)
            targets.append(_lookalike_widget(draw, widget, w, font, b))
    instr, thought = _INSTRUCTIONS[widget]
    if vocab:  # as real screens' targets are named (`miniwob_examples`): a checkbox by its label
        noun = "label" if widget == "checkbox" else widget
        instr, thought = f'Click on the "{{w}}" {noun}.', f"I will click the {noun} {{w}}."
    seen = list(zip(targets, words, strict=False))
    return instr.format(w=words[0]), targets[0], thought.format(w=words[0]), seen


LEVELS: dict[str, Callable] = {
    "big1": lambda rng, d: _level_box(rng, d, 0, header=False, size=(48, 96)),
    "box1": lambda rng, d: _level_box(rng, d, 0, header=False),
    "box1h": lambda rng, d: _level_box(rng, d, 0, header=True),
    "box4": lambda rng, d: _level_box(rng, d, rng.randint(1, 3), header=True),
    "widget1": lambda rng, d: _level_widgets(rng, d, 0, header=True),
    "widget4": lambda rng, d: _level_widgets(rng, d, rng.randint(1, 4), header=True),
    "boxes8": lambda rng, d: _level_lookalikes(rng, d, "boxes"),
    "buttons8": lambda rng, d: _level_lookalikes(rng, d, "button"),
    "links8": lambda rng, d: _level_lookalikes(rng, d, "link"),
    "texts8": lambda rng, d: _level_lookalikes(rng, d, "text"),
    "checks8": lambda rng, d: _level_lookalikes(rng, d, "checks"),
    "openchecks8": lambda rng, d: _level_lookalikes(rng, d, "checks", vocab="label"),
    "openlinks8": lambda rng, d: _level_lookalikes(rng, d, "link", vocab="lorem"),
    "opentexts8": lambda rng, d: _level_lookalikes(rng, d, "text", vocab="phrase"),
    "lorem8": lambda rng, d: _level_lookalikes(rng, d, "link", vocab="miniwob"),
    "paralinks": _level_paragraph,
}
"""Synthetic levels: `big1` one large (48-96 px) box on white; `box1` one box on white; `box1h` one box below the instruction strip; `box4` the
named box among 1-3 distractors; `widget1` one button/link/checkbox; `widget4` the named widget among 1-4
others; the reading levels (decision "Reading curriculum"): `boxes8` the named colour among 1-7 boxes of one
size, `buttons8` / `links8` / `texts8` the named word among 1-7 widgets of one kind and font size
(10-14 px), `checks8` the named checkbox in a column of 2-8; `open*` the same with words drawn fresh (decision "Open
vocabulary"); `lorem8` links of the words MiniWoB's click-link draws from, `paralinks` click-link's own
screen, a paragraph of them with links in it (decision "Lorem names"). A name maps (rng, draw) ->
(instruction, screen box, thought, seen): `seen` is every look-alike as (screen box, its colour or word),
the named one included."""


def read_aloud(seen: Sequence[tuple[tuple[int, int, int, int], str]], thought: str) -> str:
    """The thought that first reads every look-alike on the screen in reading order (top to bottom, then
    left to right by box corner), then names the target (decision "Reading aloud").

    >>> read_aloud([((50, 90, 60, 99), "ok"), ((5, 60, 30, 70), "next"), ((80, 60, 99, 70), "back")],
    ...            "I will click the button ok.")
    'I see next, back, ok. I will click the button ok.'
    """
    return f"I see {', '.join(name for _, name in _reading_order(seen))}. {thought}"


def _reading_order(seen: Sequence[tuple[tuple[int, int, int, int], str]]) -> list:
    """`seen` (screen box, name) pairs top to bottom, then left to right by the box's top-left corner: the
    one order of reading aloud and of reading examples."""
    return sorted(seen, key=lambda s: (s[0][1], s[0][0]))


def read_score(reply: str, answer: str) -> float:
    """How much of a reading example's `answer` a reply reads: the share of the answer's items read at
    their place (a missing or extra item counts as wrong; an unparsable reply or another action 0).

    >>> read_score("Thought: x\\nAction: finished(content='red, blue, gray')", "red, green, gray")
    0.6666666666666666
    """
    try:
        actions = parse_response(reply).actions
    except ActionParseError:
        return 0.0
    if len(actions) != 1 or actions[0].kind != "finished" or actions[0].content is None:
        return 0.0
    got, want = actions[0].content.split(", "), answer.split(", ")
    return sum(g == w for g, w in zip(got, want, strict=False)) / max(len(got), len(want))


READ_NOUNS = {
    "big1": "box colours",
    "box1": "box colours",
    "box1h": "box colours",
    "box4": "box colours",
    "boxes8": "box colours",
    "widget1": "widgets",
    "widget4": "widgets",
    "buttons8": "buttons",
    "links8": "links",
    "texts8": "words",
    "checks8": "checkbox labels",
    "openchecks8": "checkbox labels",
    "openlinks8": "links",
    "opentexts8": "words",
    "lorem8": "links",
    "paralinks": "links",
}
"""What a reading example of each level asks to read (decision "Reading examples")."""


def synthetic_example(
    rng: random.Random,
    level: str,
    model_size: tuple[int, int] = (168, 224),
    aloud: bool = False,
    read: bool = False,
) -> GroundExample:
    """One synthetic 160x210 screen of `level` (see LEVELS); deterministic in the rng state. With `aloud`
    the thought first reads every look-alike (`read_aloud`); with `read` it is a reading example
    instead of a click: "Read the buttons from top to bottom." -> finished(content='next, back, ok')
    (decision "Reading examples"). The screen below the instruction strip is the same in all three."""
    img = Image.new("RGB", (SCREEN_W, SCREEN_H), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    instr, box, thought, seen = LEVELS[level](rng, draw)
    answer = None
    if read:
        ordered = _reading_order(seen)
        box, answer = ordered[0][0], ", ".join(name for _, name in ordered)
        instr, thought = (
            f"Read the {READ_NOUNS[level]} from top to bottom.",
            f"I read the {READ_NOUNS[level]}.",
        )
    elif aloud:
        thought = read_aloud(seen, thought)
    if level not in ("box1", "big1"):
        _header(draw, instr)
    sx, sy = _scale((SCREEN_W, SCREEN_H), model_size)
    centre, mbox = _to_model_box(box, sx, sy)
    others = tuple(_to_model_box(b, sx, sy)[1] for b, _ in seen if b != box)
    colours = level.startswith(("big", "box"))
    named = tuple((_to_model_box(b, sx, sy)[1], f"{n} box" if colours else n) for b, n in seen)
    return GroundExample(img, instr, centre, mbox, f"synthetic/{level}", thought, others, answer, named)


def synthetic_examples(
    n: int,
    mix: dict[str, float],
    seed: int = 0,
    model_size: tuple[int, int] = (168, 224),
    aloud: bool = False,
    read: bool = False,
) -> list[GroundExample]:
    """`n` synthetic examples, levels drawn with the weights of `mix`; deterministic in `seed` (with `aloud`
    or `read`, the same screens: see `synthetic_example`)."""
    rng = random.Random(seed)
    names, weights = zip(*sorted(mix.items()), strict=True)
    return [synthetic_example(rng, rng.choices(names, weights)[0], model_size, aloud, read) for _ in range(n)]


# ----------------------------------------------------------------------------------------------------
# Naming loss (decision "Naming loss")

NAMES: tuple[str, ...] = (*(f"{c} box" for c in sorted(COLORS)), *WORDS)
"""The labels the naming loss tells apart: a box's colour ("red box"), or a widget's word."""

NAME_WINDOW_SCREEN_PX = (84, 56)
"""The screen region around a look-alike's centre whose merged image tokens the naming head reads (width,
height): 3 x 2 tokens of the tiny policy at 1x, more at a higher visual resolution."""


def name_window(
    box: tuple[float, float, float, float], scale: tuple[float, float], unit: int
) -> tuple[int, int, int, int]:
    """(first row, first column, rows, columns) of the merged image tokens around `box` (model pixels) on a
    token grid of `unit` model px, `scale` the model pixels per screen pixel (x, y): a window of
    `NAME_WINDOW_SCREEN_PX` screen px, the same number of tokens wherever the box is.

    >>> name_window((40.0, 30.0, 60.0, 40.0), (1.05, 1.07), 28)
    (0, 0, 2, 3)
    """
    cx, cy = (box[0] + box[2]) / 2 / unit, (box[1] + box[3]) / 2 / unit  # in tokens
    half_w = NAME_WINDOW_SCREEN_PX[0] / 2 * scale[0] / unit
    half_h = NAME_WINDOW_SCREEN_PX[1] / 2 * scale[1] / unit
    return math.floor(cy - half_h + 0.5), math.floor(cx - half_w + 0.5), round(2 * half_h), round(2 * half_w)


def window_tokens(
    policy: Policy,
    images: Sequence[Image.Image],
    boxes: Sequence[Sequence[tuple[float, float, float, float]]],
    inside: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The merged image tokens (what the language model gets from the vision tower) in the `name_window`
    of each box of each image (`boxes[i]` in model pixels of image i's frame), concatenated in raster order,
    zeros off the image -> (boxes in all, window tokens x hidden); differentiable in the vision tower. One
    tower call for all images. With `inside`, also which window tokens are the box's (`box_window_mask`)
    -> (boxes in all, window tokens), bool."""
    from arpo_core.policy.model import image_inputs

    proc = policy.processor.image_processor
    merge = int(proc.merge_size)
    unit = int(proc.patch_size) * merge
    pixels, grid = image_inputs(proc, list(images))
    out = policy.model.model.visual(pixels.to(policy.device), grid_thw=grid.to(policy.device))
    tokens = getattr(out, "pooler_output", out)
    feats, masks, at = [], [], 0
    for img, img_boxes, (_, gh, gw) in zip(images, boxes, grid.tolist(), strict=True):
        rows, cols = gh // merge, gw // merge
        tok = tokens[at : at + rows * cols].reshape(rows, cols, -1)
        at += rows * cols
        scale = (cols * unit / img.size[0], rows * unit / img.size[1])
        padded = None
        for box in img_boxes:
            r0, c0, nh, nw = name_window(box, scale, unit)
            if padded is None:  # zeros around the grid, as wide as a window
                padded = torch.nn.functional.pad(tok, (0, 0, nw, nw, nh, nh))
            feats.append(padded[r0 + nh : r0 + 2 * nh, c0 + nw : c0 + 2 * nw].reshape(-1))
            if inside:
                masks.append(box_window_mask(box, (r0, c0, nh, nw), unit))
    if inside:
        return torch.stack(feats), torch.stack(masks).to(feats[0].device)
    return torch.stack(feats)


def box_window_mask(
    box: tuple[float, float, float, float], window: tuple[int, int, int, int], unit: int
) -> torch.Tensor:
    """Which tokens of `window` (`name_window`'s (first row, first column, rows, columns)) are the box's:
    those whose centre lies in `box` (model pixels on a token grid of `unit` px), or, for a box too small to
    hold a token's centre, the token under the box's centre -> (rows x columns,) bool, raster order.

    >>> box_window_mask((30.0, 0.0, 90.0, 20.0), (0, 0, 1, 4), 28).tolist()
    [False, True, True, False]
    >>> box_window_mask((30.0, 0.0, 40.0, 10.0), (0, 0, 1, 4), 28).tolist()
    [False, True, False, False]
    """
    r0, c0, nh, nw = window
    rows = (torch.arange(r0, r0 + nh, dtype=torch.float64) + 0.5) * unit
    cols = (torch.arange(c0, c0 + nw, dtype=torch.float64) + 0.5) * unit
    mask = ((rows >= box[1]) & (rows <= box[3]))[:, None] & ((cols >= box[0]) & (cols <= box[2]))[None, :]
    if not mask.any():
        r = min(max(math.floor((box[1] + box[3]) / 2 / unit) - r0, 0), nh - 1)
        c = min(max(math.floor((box[0] + box[2]) / 2 / unit) - c0, 0), nw - 1)
        mask[r, c] = True
    return mask.reshape(-1)


# ----------------------------------------------------------------------------------------------------
# Real MiniWoB screens (decision "Two sources")


def element_kind(tag: str, classes: str) -> str:
    """How an instruction names a DOM element: button, link (MiniWoB links are `span.alink`), label, text.

    >>> element_kind("span", "alink"), element_kind("button", ""), element_kind("div", "")
    ('link', 'button', 'text')
    """
    if tag.startswith("button") or tag == "input_submit":
        return "button"
    if tag == "a" or "alink" in classes.split():
        return "link"
    if tag == "label":
        return "label"
    return "text"


def miniwob_examples(
    env,
    tasks: Sequence[str],
    seeds: Sequence[int],
    model_size: tuple[int, int] = (168, 224),
    max_per_screen: int = 4,
    domain: str = "miniwob",
) -> list[GroundExample]:
    """Grounding examples from real MiniWoB screens: for each task and seed, reset the env and make every
    visible, topmost element with a unique short text (outside the instruction strip, narrower than the
    task area: full-width blocks have no meaningful centre) a target, "Click on the "<text>" <kind>." ->
    its centre. `env` is a `MiniWoBEnv` (anything with reset,
    dom_elements and screenshot); at most `max_per_screen` targets per screen (the first ones by a
    seeded shuffle)."""
    from arpo_core.envs.base import TaskSpec

    out: list[GroundExample] = []
    for task in tasks:
        for seed in seeds:
            obs = env.reset(TaskSpec(domain=domain, task_id=task), seed=seed)
            shot = obs.screenshot
            sx, sy = _scale(shot.size, model_size)
            els = [
                e
                for e in env.dom_elements()
                if e.visible
                and e.topmost
                and e.text
                and len(e.text) <= 24
                and e.bbox[1] >= HEADER_H
                and e.bbox[2] >= 4
                and e.bbox[3] >= 4
            ]
            counts = Counter(e.text.lower() for e in els)
            els = [e for e in els if counts[e.text.lower()] == 1]
            random.Random(seed).shuffle(els)
            placed = [_to_model_box((x, y, x + w, y + h), sx, sy) for x, y, w, h in (e.bbox for e in els)]
            # every unique-text element with its text (decision "Lorem names")
            named = tuple((b, e.text) for (_, b), e in zip(placed, els, strict=True))
            for i, e in enumerate(els[:max_per_screen]):
                centre, mbox = placed[i]
                kind = element_kind(e.tag, e.classes)
                instr = f'Click on the "{e.text}" {kind}.'
                thought = f"I will click the {kind} {e.text}."
                others = tuple(b for j, (_, b) in enumerate(placed) if j != i)
                out.append(
                    GroundExample(
                        shot, instr, centre, mbox, f"miniwob/{task}", thought, others, kind=kind, named=named
                    )
                )
    return out


def make_grounding_examples(
    n_synthetic: int,
    mix: dict[str, float],
    seed: int = 0,
    env=None,
    tasks: Sequence[str] = (),
    seeds: Sequence[int] = (),
    model_size: tuple[int, int] = (168, 224),
) -> list[GroundExample]:
    """A fixed grounding set: `n_synthetic` synthetic screens of `mix` plus, when an env is given, the
    real MiniWoB targets of `tasks` x `seeds` (see `miniwob_examples`)."""
    out = synthetic_examples(n_synthetic, mix, seed, model_size) if n_synthetic else []
    if env is not None and tasks:
        out += miniwob_examples(env, tasks, seeds, model_size)
    return out


def to_trajectory(ex: GroundExample, run_id: str = "ground") -> Trajectory:
    """A one-step Trajectory of an example (stage "ground"), e.g. to mix grounding into `behaviour_cloning.sft`."""
    step = Step(0, png_bytes(ex.image), ex.image.size[0], ex.image.size[1], ex.reply, done=True)
    domain, _, task = ex.source.partition("/")
    return Trajectory(run_id, "ground", 0, domain, task, ex.instruction, [step], success=1.0, reward=1.0)


# ----------------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class GroundConfig(GroundTrainConfig):
    """The training loop's config: the shared fields of `GroundTrainConfig` (a params phase has the same
    ones) plus a curriculum and evaluation settings. The prompt is not here
    (decision "Library training loop")."""

    curriculum: tuple[tuple[int, dict[str, float]], ...] = ()
    """(start step, mix) phases; from each start step on, that mix is used (empty: `mix` throughout)."""
    pattern: float = 0.0
    """Experimental: strength of the coordinate code blended into the pixels (coord_pattern); 0 = off."""

    def mix_at(self, step: int) -> dict[str, float]:
        """The level mix in force at optimizer step `step` (1-based)."""
        mix = self.mix
        for start, m in self.curriculum:
            if step >= start:
                mix = m
        return mix


def coord_pattern(image: Image.Image, model_size: tuple[int, int], strength: float) -> Image.Image:
    """Resize to the model frame and blend in a fixed coordinate code: pixel (x, y) becomes
    (1 - s) * pixel + s * (255 x / w, 255 y / h, 128). Experimental (decision "Rotary frequencies"); strength
    0 = identity apart from the resize, which the image processor would do anyway."""
    img = image.convert("RGB").resize(model_size, Image.BICUBIC)
    if strength <= 0:
        return img
    w, h = model_size
    xs = np.broadcast_to(np.linspace(0, 255, w, dtype=np.float32)[None, :], (h, w))
    ys = np.broadcast_to(np.linspace(0, 255, h, dtype=np.float32)[:, None], (h, w))
    code = np.stack([xs, ys, np.full((h, w), 128.0, np.float32)], axis=-1)  # (H, W, 3)
    pix = np.asarray(img, dtype=np.float32)  # (H, W, 3)
    out = np.clip(np.rint((1 - strength) * pix + strength * code), 0, 255).astype(np.uint8)
    return Image.fromarray(out, "RGB")


def _encode(policy: Policy, ex: GroundExample, system: str, pattern: float = 0.0, reply: str | None = None):
    """`ex` as a training sequence: its instruction, screen (with the coordinate `pattern`) and reply (or
    `reply`)."""
    segs = build_segments(
        ex.instruction, 1, [ex.reply if reply is None else reply], spec=PromptSpec(system, None)
    )
    img = ex.image
    if pattern > 0:
        img = coord_pattern(img, model_image_size(*img.size, policy.min_pixels, policy.max_pixels), pattern)
    return encode_segments(policy, segs, [img])


def _model_groups(
    model: torch.nn.Module, lr: float, vision_scale: float, grown: Sequence[str], grown_scale: float
) -> list[dict]:
    """The model's optimizer groups: the language model at `lr`, the tower at `lr * vision_scale` (one group
    with the LM when that is 1), and, when `grown_scale` is not 1, the parameters named under `grown`
    apart at their part's rate times it (decision "Grown layers' rate"). Without a scale the groups (and
    their order, which a checkpoint's optimizer state follows) are those of the runs before the field."""
    if vision_scale == 1 and grown_scale == 1:
        return [{"params": list(model.parameters()), "lr": lr}]
    tower = {id(p) for p in model.model.visual.parameters()}
    parts: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {
        (t, g): [] for t in (False, True) for g in (False, True)
    }
    for name, p in model.named_parameters():
        is_grown = grown_scale != 1 and name.startswith(tuple(grown))
        parts[(vision_scale != 1 and id(p) in tower, is_grown)].append(p)
    return [
        {"params": ps, "lr": lr * (vision_scale if t else 1) * (grown_scale if g else 1)}
        for (t, g), ps in parts.items()
        if ps
    ]


def train_grounding(
    policy: Policy,
    config: GroundConfig,
    *,
    system: str,
    max_new_tokens: int,
    examples: Sequence[GroundExample] | None = None,
    heldout: Sequence[GroundExample] | Mapping[str, Sequence[GroundExample]] | None = None,
    time_limit_s: float | None = None,
    callback: Callable[[dict], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every_s: float | None = None,
    gate: Sequence[str] | None = None,
    heads_from: Path | None = None,
    grown: Sequence[str] = (),
) -> dict:
    """Train `policy` in place on grounding replies with system prompt `system`; returns the history.
    Held-out evaluations decode greedily up to `max_new_tokens` tokens.

    Examples come from `examples` (a fixed list, e.g. real MiniWoB screens, cycled in seeded order)
    mixed with fresh synthetic screens: with a fixed list each batch takes half from the list and half
    synthetic; without one all are synthetic. The loss is BC's token-mean NLL of the reply
    (decision "Grounding example"). History: {"loss": [per step], "evals": [{"step", "seconds", **metrics}],
    "seconds": total}; with several named held-out sets (a mapping) an evaluation has `<name>/<measure>`
    keys and `hit_rate`, the lowest of the `gate` sets' (default: every click set, not a reading set).
    With `config.until_hit` the loop ends at the first evaluation whose `hit_rate` reaches it (history
    "stopped_at"). With `eval_every` the
    start is measured too (step 0, no loss yet; a start that already reaches `until_hit` trains no step).
    `callback` gets each evaluation dict as it is made (for a driver to print or save, the stage to log).
    With `checkpoint` (a file path) the loop saves its state there every `checkpoint_every_s` seconds and at
    the end, and resumes from it when it exists (decision "Resumable training").
    With `config.carry_heads`, `heads_from` (the previous phase's checkpoint file) gives a fresh run's heads
    their start (decision "Carried heads").
    `grown` names the parameters (prefixes of their names) of the layers grown for this run, which train at
    `config.grown_lr_scale` times their part's rate (decision "Grown layers' rate").
    """
    if (checkpoint is None) != (checkpoint_every_s is None):
        raise ValueError("train_grounding: give checkpoint and checkpoint_every_s together")
    if bool(config.carry_heads) != (heads_from is not None):
        raise ValueError(
            "train_grounding: carry_heads and heads_from (the previous phase's checkpoint) go together"
        )
    if config.until_hit is not None and not (heldout and config.eval_every):
        raise ValueError("train_grounding: until_hit needs held-out examples and eval_every > 0")
    model = policy.model
    device = policy.device
    rng = random.Random(config.seed)
    msize = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
    lr = config.optimizer.lr
    if config.grown_lr_scale != 1 and not grown:
        raise ValueError("train_grounding: grown_lr_scale needs `grown`, the parameters of the grown layers")
    groups = _model_groups(model, lr, config.vision_lr_scale, grown, config.grown_lr_scale)
    head = None
    if config.name_weight:  # the naming loss's head: the phase's own, in its checkpoint, then discarded
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            shape = _name_window_shape(policy, msize)
            names = name_vocab(config.name_vocab)
            if config.name_tied:
                head = TiedNameHead(*shape, _name_token_ids(policy, names))
            elif config.name_token:
                head = TokenNameHead(shape[1], len(names))
            else:
                head = NameHead(*shape, len(names))
            head = head.to(device)
        groups.append({"params": list(head.parameters()), "lr": lr})
    scale = (msize[0] / SCREEN_W, msize[1] / SCREEN_H)  # model px per screen px
    speller = None
    if config.spell_weight:  # the spelling loss's head: like the naming head, the phase's own
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            speller = NameHead(*_name_window_shape(policy, msize), len(SPELL_CHARS)).to(device)
        groups.append({"params": list(speller.parameters()), "lr": lr})
    if config.quote_names:  # decision "Quoted names": the fixed list's and held-out replies too
        examples = None if examples is None else [quote_name(e) for e in examples]
        if isinstance(heldout, Mapping):
            heldout = {k: [quote_name(e) for e in v] for k, v in heldout.items()}
        elif heldout is not None:
            heldout = [quote_name(e) for e in heldout]
    probe = None
    if config.place_weight:  # the place loss's probe: like the naming head, the phase's own
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            probe = PlaceProbe(policy.model.config.text_config.hidden_size).to(device)
        groups.append({"params": list(probe.parameters()), "lr": lr})
    trained = [p for g in groups for p in g["params"]]  # what the shared gradient-norm clip spans
    matcher = None
    if config.match_weight:  # the match loss's head: the phase's own, clipped apart (decision "Match loss")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            hidden = policy.model.config.text_config.hidden_size
            matcher = MatchHead(hidden, len(name_vocab(config.name_vocab))).to(device)
        groups.append({"params": list(matcher.parameters()), "lr": lr * config.match_lr_scale})
    optimizer = torch.optim.AdamW(groups, weight_decay=config.optimizer.weight_decay)
    own_clip = [] if matcher is None else list(matcher.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.warmup_steps, config.steps, config.min_lr_frac)
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if config.optimizer.bf16 else nullcontext()
    order: list[int] = []
    history: dict = {"loss": [], "evals": []} | ({"name_loss": []} if head is not None else {})
    if config.point_weight:
        history["point_loss"] = []
    if probe is not None:
        history["place_loss"] = []
    if matcher is not None:
        history["match_loss"] = []
    if speller is not None:
        history["spell_loss"] = []
    t0 = time.perf_counter()
    done = 0
    fingerprint = checkpoint_fingerprint(config, system, examples) if checkpoint is not None else None
    resuming = checkpoint is not None and Path(checkpoint).exists()
    if heads_from is not None and not resuming:  # decision "Carried heads"
        own = {"head": head, "speller": speller, "probe": probe, "matcher": matcher}
        carried = own if config.carry_heads is True else {k: own[k] for k in config.carry_heads}
        _carry_heads(Path(heads_from), carried)
    if resuming:
        state = torch.load(checkpoint, weights_only=False)
        if state["fingerprint"] != fingerprint:
            raise ValueError(
                f"grounding checkpoint {checkpoint} was made with another config, prompt or example list "
                f"(fingerprint {state['fingerprint']}, this run's {fingerprint}): remove it to start over"
            )
        model.load_state_dict(state["model"])
        if head is not None:
            head.load_state_dict(state["head"])
        if probe is not None:
            probe.load_state_dict(state["probe"])
        if matcher is not None:
            matcher.load_state_dict(state["matcher"])
        if speller is not None:
            speller.load_state_dict(state["speller"])
        optimizer.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        order, history, done = state["order"], state["history"], state["step"]
        t0 -= state["seconds"]
        if "stopped_at" in history:  # ended early (until_hit): finished, like a last step
            done = config.steps
    saved_at = time.perf_counter()

    def save(step: int) -> None:
        nonlocal saved_at
        state = {
            "fingerprint": fingerprint,
            "step": step,
            "model": model.state_dict(),
            "head": None if head is None else head.state_dict(),
            "probe": None if probe is None else probe.state_dict(),
            "matcher": None if matcher is None else matcher.state_dict(),
            "speller": None if speller is None else speller.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "order": list(order),
            "history": history,
            "seconds": time.perf_counter() - t0,
        }
        with atomic_open(checkpoint, "wb") as f:
            torch.save(state, f)
        saved_at = time.perf_counter()

    def evaluate(step: int) -> bool:
        """Measure the held-out sets at `step`; True when `until_hit` is reached."""
        ev = {"step": step, "seconds": round(time.perf_counter() - t0, 1)}
        ev |= _measure(
            policy, heldout, system, max_new_tokens, config.pattern, gate, read=bool(config.point_weight)
        )
        if head is not None:
            ev |= _name_accuracy(policy, head, heldout, config.name_vocab)
        if config.point_weight or probe is not None or matcher is not None:
            heads = config.point_heads if config.point_weight else 0
            ev |= _attention_measures(
                policy, heldout, system, config.pattern, heads, probe, matcher, config.name_vocab
            )
        if speller is not None:
            ev |= _spell_measures(policy, speller, heldout, scale)
        if history["loss"]:  # none yet at step 0
            ev["loss"] = sum(history["loss"][-20:]) / len(history["loss"][-20:])
        history["evals"].append(ev)
        reached = config.until_hit is not None and ev["hit_rate"] >= config.until_hit
        if reached:
            history["stopped_at"] = step
        if callback is not None:
            callback(ev)
        return reached

    # the start, so that a curve shows what training bought; a level already mastered is passed at once
    start_measured = heldout and config.eval_every and done == 0
    if start_measured and evaluate(0):
        done = config.steps
        if checkpoint is not None:
            save(0)
    for step in range(done + 1, config.steps + 1):
        mix = config.mix_at(step)
        n_fixed = config.batch_size // 2 if examples and not config.name_only else 0
        batch_ex: list[GroundExample] = []
        for _ in range(n_fixed):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch_ex.append(examples[order.pop()])
        names, weights = zip(*sorted(mix.items()), strict=True)
        for _ in range(config.batch_size - n_fixed):
            level = rng.choices(names, weights)[0]
            read = config.read_share > 0 and rng.random() < config.read_share  # 0: the stream as before
            ex = synthetic_example(rng, level, msize, config.read_aloud, read)
            batch_ex.append(quote_name(ex) if config.quote_names else ex)
        model.train()
        loss = None
        point_loss = place_loss = match_loss = None
        if not config.name_only:  # a naming-only phase trains the tower alone: no reply is encoded
            encoded = [_encode(policy, e, system, config.pattern) for e in batch_ex]
            batch = collate(encoded, policy.pad_id, policy.image_token_id).to(device)
            capturing = config.point_weight or probe is not None or matcher is not None
            captured = _PointCapture(policy, config.point_heads) if capturing else nullcontext()
            with autocast, captured as capture:
                logps, mask = sequence_logprobs(model, batch)  # (B, T) each
                if config.point_weight:
                    point_loss = capture.loss(_point_spans(policy, encoded, batch_ex, config.point_first))
                if probe is not None:
                    place_loss = _place_loss(policy, probe, capture.inputs[0], encoded)
                if matcher is not None:
                    read = capture.inputs[0] if step > config.match_warmup else capture.inputs[0].detach()
                    items = match_items(policy, read, encoded, batch_ex, config.name_vocab)
                    match_loss = _match_loss(matcher, items)
            loss = -(logps * mask).sum() / mask.sum().clamp(min=1)
        total = loss
        if point_loss is not None:
            total = total + config.point_weight * point_loss
            history["point_loss"].append(float(point_loss.detach()))
        if place_loss is not None:
            total = total + config.place_weight * place_loss
            history["place_loss"].append(float(place_loss.detach()))
        if match_loss is not None:
            total = total + config.match_weight * match_loss
            history["match_loss"].append(float(match_loss.detach()))
        if head is not None:
            named = [e for e in batch_ex if has_names(e, config.name_vocab)]
            if named:
                with autocast:
                    logits, labels = _name_logits(policy, head, named, config.name_vocab)
                name_loss = torch.nn.functional.cross_entropy(logits.float(), labels)
                total = config.name_weight * name_loss + (0 if total is None else total)
                history["name_loss"].append(float(name_loss.detach()))
                loss = name_loss if loss is None else loss
        if speller is not None:
            with autocast:
                got = _spell_logits(policy, speller, batch_ex, scale)
            if got is not None:
                spelt = spell_loss(*got)
                total = config.spell_weight * spelt + (0 if total is None else total)
                history["spell_loss"].append(float(spelt.detach()))
                loss = spelt if loss is None else loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(trained, config.optimizer.max_grad_norm)
        if own_clip:
            torch.nn.utils.clip_grad_norm_(own_clip, config.optimizer.max_grad_norm)
        optimizer.step()
        sched.step()
        history["loss"].append(float(loss.detach()))
        last = step == config.steps
        out_of_time = time_limit_s is not None and time.perf_counter() - t0 > time_limit_s
        reached = False
        if heldout and (last or out_of_time or (config.eval_every and step % config.eval_every == 0)):
            reached = evaluate(step)
        if checkpoint is not None and (
            last or out_of_time or reached or time.perf_counter() - saved_at >= checkpoint_every_s
        ):
            save(step)
        if out_of_time or reached:
            break
    model.eval()
    history["seconds"] = time.perf_counter() - t0
    history["steps"] = len(history["loss"])
    return history


def _measure(
    policy: Policy,
    heldout: Sequence[GroundExample] | Mapping[str, Sequence[GroundExample]],
    system: str,
    max_new_tokens: int,
    pattern: float,
    gate: Sequence[str] | None = None,
    read: bool = False,
) -> dict:
    """One evaluation's measures: a list's GroundMetrics, or per named set `<name>/<measure>` (a reading
    set: `read_score`) plus `hit_rate`, the lowest of the `gate` sets' (default every click set; the one
    `until_hit` waits for). With `read` (a phase that teaches the pointing head) each click set adds
    `cell_hit`, the hit rate of the same replies' clicks read off head 0 (`attention_clicks`, `cell`)."""
    if not isinstance(heldout, Mapping):
        return evaluate_grounding(
            policy, heldout, system=system, max_new_tokens=max_new_tokens, pattern=pattern
        ).as_dict()
    out: dict = {}
    for name, exs in heldout.items():
        if exs and exs[0].answer is not None:  # a reading set
            score = evaluate_reading(policy, exs, system=system, max_new_tokens=max_new_tokens)
            out[f"{name}/read_score"] = round(score, 4)
            continue
        replies = (
            None if pattern else greedy_replies(policy, exs, system=system, max_new_tokens=max_new_tokens)
        )
        clicks = None if replies is None else [first_click(r) for r in replies]
        m = evaluate_grounding(
            policy, exs, system=system, max_new_tokens=max_new_tokens, pattern=pattern, clicks=clicks
        )
        out |= {f"{name}/{k}": v for k, v in m.as_dict().items()}
        if read and replies is not None:  # decision "Pointing loss": the click the head would give
            cells = attention_clicks(policy, exs, replies, system=system, readout="cell")
            hits = [click_outcome(c, e.bbox, e.lookalikes)[0] for c, e in zip(cells, exs, strict=True)]
            out[f"{name}/cell_hit"] = round(sum(hits) / max(len(hits), 1), 4)
        copied = (
            []
            if replies is None
            else [c for e, r in zip(exs, replies, strict=True) if (c := copies(e, r)) is not None]
        )
        if copied:  # the set's instructions quote their names (real screens', the open levels')
            out[f"{name}/copy_rate"] = round(sum(copied) / len(copied), 4)
    gated = [n for n in heldout if f"{n}/hit_rate" in out] if gate is None else gate
    out["hit_rate"] = min(out[f"{name}/hit_rate"] for name in gated)
    return out


def point_spans(
    policy: Policy, enc: EncodedSequence, ex: GroundExample, first: bool = False
) -> tuple[list[int], list[int]]:
    """(query positions, target positions) of the pointing loss in one encoded example: the positions whose
    next token is part of the click's coordinates (the reply's `start_box='(x,y)'`, so they predict x and
    y), and the merged image tokens whose 28-px cell (the policy's `patch_size * merge_size` model px)
    overlaps the target's box, at least the one under its centre. Both empty when the reply has no click
    (a reading example) or the sequence no image. A cell is one of `image_cells`. With `first`, only the
    two positions that predict the first character of x and of y (decision "First digits")."""
    if enc.image_grid_thw is None or "start_box='(" not in ex.reply:
        return [], []
    queries = click_positions(policy, enc, first)
    if queries is None:
        raise ValueError(f"the click of {ex.reply!r} is not in its decoded tokens")
    return queries, box_tokens(policy, enc, ex.bbox) if queries else []


def box_tokens(policy: Policy, enc: EncodedSequence, box: tuple[float, float, float, float]) -> list[int]:
    """Positions in `enc` of the merged image tokens whose cell (`image_cells`) overlaps `box` (model px),
    at least the one under its centre (`point_spans`)."""
    unit = cell_size(policy)
    image, rows, cols = image_cells(policy, enc)
    x0, y0, x1, y1 = box
    cells = {
        r * cols + c
        for r in range(rows)
        for c in range(cols)
        if c * unit < x1 and (c + 1) * unit > x0 and r * unit < y1 and (r + 1) * unit > y0
    }
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    cells.add(min(rows - 1, max(0, int(cy // unit))) * cols + min(cols - 1, max(0, int(cx // unit))))
    return [image[c] for c in sorted(cells)]


def _point_spans(
    policy: Policy, encoded: Sequence[EncodedSequence], examples: Sequence[GroundExample], first: bool = False
) -> list[tuple[list[int], list[int]]]:
    return [point_spans(policy, enc, ex, first) for enc, ex in zip(encoded, examples, strict=True)]


class _PointCapture(HeadWeights):
    """`HeadWeights` of the pointing loss: its loss, masses, and rows of weights already computed."""

    def at(
        self,
        weights: Sequence[torch.Tensor],
        queries: Sequence[Sequence[int]],
        chosen: Sequence[Sequence[int]],
    ) -> list[torch.Tensor]:
        """The rows of `log_weights(queries)` at the positions `chosen[b]` (a subset of `queries[b]`), every
        head's: the weights of those positions without computing them again."""
        out = []
        for w, pos, pick in zip(weights, queries, chosen, strict=True):
            if not pos:  # no click in the reply: no rows
                out.append(w)
                continue
            rows = [pos.index(p) for p in pick]
            out.append(w.view(self.heads, len(pos), -1)[:, rows].reshape(self.heads * len(rows), -1))
        return out

    def loss(self, spans: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
        """Mean over the heads and query positions of -log(a head's attention mass on the target tokens)
        (`HeadWeights.point_terms`, one span per row); 0 without a term."""
        terms = self.point_terms([[span] for span in spans])
        return terms.mean() if len(terms) else self.inputs[0].new_zeros(()).float()

    def masses(
        self,
        queries: Sequence[Sequence[int]],
        *token_sets: Sequence[Sequence[int]],
        weights: Sequence[torch.Tensor] | None = None,
    ) -> list[list[float]]:
        """For each of `token_sets` (one token list per row), the heads' mean attention mass on those tokens
        per row (nan without queries or tokens); the weights are computed once for all the sets, or given
        (`log_weights` of `queries`, or `at` of them)."""
        weights = self.log_weights(queries) if weights is None else weights
        return [
            [
                float(torch.logsumexp(w[:, list(t)], dim=-1).exp().mean()) if q and t else float("nan")
                for w, q, t in zip(weights, queries, tokens, strict=True)
            ]
            for tokens in token_sets
        ]


def attention_points(
    policy: Policy,
    examples: Sequence[GroundExample],
    replies: Sequence[str],
    *,
    system: str,
    heads: int = 1,
    positions: str = "x",
    batch_size: int = 16,
) -> list[Pointed | None]:
    """What the pointing heads read for `replies` on the examples' screens and instructions (`heads.pointed`:
    policy/heads.py, decision "Clicks read from the pointing head"), one forward for every readout
    (`Pointed.click`); None where a reply has no click (`first_click`)."""
    encoded = [_encode(policy, e, system, reply=t) for e, t in zip(examples, replies, strict=True)]
    read = pointed(policy, encoded, heads=heads, positions=positions, batch_size=batch_size)
    return [p if first_click(t) is not None else None for p, t in zip(read, replies, strict=True)]


def attention_clicks(
    policy: Policy,
    examples: Sequence[GroundExample],
    replies: Sequence[str],
    *,
    system: str,
    readout: str = "cell",
    heads: int = 1,
    positions: str = "x",
    batch_size: int = 16,
) -> list[tuple[float, float] | None]:
    """The clicks `readout` reads off `attention_points`; None where a reply has no click."""
    Pointed.check(readout)
    read = attention_points(
        policy, examples, replies, system=system, heads=heads, positions=positions, batch_size=batch_size
    )
    return [p.click(readout) if p is not None else None for p in read]


def _name_window_shape(policy: Policy, msize: tuple[int, int]) -> tuple[int, int]:
    """(tokens in a `name_window`, the language model's hidden size) at the policy's resolution."""
    unit = cell_size(policy)
    _, _, nh, nw = name_window((0.0, 0.0, 0.0, 0.0), (msize[0] / SCREEN_W, msize[1] / SCREEN_H), unit)
    return nh * nw, int(policy.model.config.text_config.hidden_size)


# ----------------------------------------------------------------------------------------------------
# Place loss (decision "Place loss")


class PlaceProbe(torch.nn.Module):
    """The place loss's probe: one linear map of an image token's hidden state, where the last decoder
    layer reads it (after that layer's input norm), to the token's (row, column), each in [-1, 1]."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 2)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.linear(states.float())


def place_targets(policy: Policy, enc: EncodedSequence) -> tuple[list[int], torch.Tensor]:
    """(positions, places) of the merged image tokens of `enc`'s one screenshot: their positions in the
    sequence (raster order, `image_cells`) and each cell's centre as (row, column) on the token grid,
    scaled to [-1, 1]. Empty without an image."""
    image, rows, cols = image_cells(policy, enc)
    if not image:
        return [], torch.zeros(0, 2)
    r = (torch.arange(rows, dtype=torch.float32) + 0.5) / rows * 2 - 1
    c = (torch.arange(cols, dtype=torch.float32) + 0.5) / cols * 2 - 1
    places = torch.stack(torch.meshgrid(r, c, indexing="ij"), dim=-1).reshape(rows * cols, 2)
    return image, places


def _place_pairs(
    policy: Policy, probe: PlaceProbe, states: torch.Tensor, encoded: Sequence[EncodedSequence]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's (row, column) of every image token of the batch and the true ones, stacked."""
    preds, truth = [], []
    with torch.autocast(states.device.type, enabled=False):
        for b, enc in enumerate(encoded):
            positions, places = place_targets(policy, enc)
            if positions:
                preds.append(probe(states[b, positions]))
                truth.append(places.to(states.device))
    if not preds:
        return states.new_zeros((0, 2), dtype=torch.float32), states.new_zeros((0, 2), dtype=torch.float32)
    return torch.cat(preds), torch.cat(truth)


def _place_loss(
    policy: Policy, probe: PlaceProbe, states: torch.Tensor, encoded: Sequence[EncodedSequence]
) -> torch.Tensor:
    """Mean squared error of the probe's places over the batch's image tokens (0 without an image)."""
    pred, truth = _place_pairs(policy, probe, states, encoded)
    if not len(pred):
        return states.new_zeros((), dtype=torch.float32)
    return torch.nn.functional.mse_loss(pred, truth)


# ----------------------------------------------------------------------------------------------------
# Naming loss: its heads (decision "Naming loss")


class NameHead(torch.nn.Module):
    """The naming loss's head: each window token layer-normalised without parameters (the tower's
    tokens are as large as the language model's inputs need, tens of units, so the loss starts at chance
    whatever their scale), then one linear map of the window to `NAMES` logits (or `outputs` of them: the
    spelling loss's head has one per character of `SPELL_CHARS`, decision "Spelling loss")."""

    def __init__(self, tokens: int, hidden: int, outputs: int = len(NAMES)):
        super().__init__()
        self.hidden = hidden
        self.linear = torch.nn.Linear(tokens * hidden, outputs)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        x = windows.reshape(windows.shape[0], -1, self.hidden).float()
        x = torch.nn.functional.layer_norm(x, (self.hidden,))
        return self.linear(x.reshape(windows.shape[0], -1))


class TiedNameHead(torch.nn.Module):
    """The naming loss's head tied to the language model (`name_tied`): a name's vector is the model's own
    input embedding of its text (`_name_token_ids`; detached: the naming loss moves the tower, not the
    embeddings), each window token is scored by its cosine with it, and the window's logit is its best
    token's, times one learned scale. No map between the spaces is learned, so the tower is taught to make
    a word's image token point where the word's text token points."""

    def __init__(self, tokens: int, hidden: int, name_ids: Sequence[Sequence[int]]):
        super().__init__()
        self.hidden = hidden
        self.log_scale = torch.nn.Parameter(torch.tensor(math.log(10.0)))
        width = max(len(ids) for ids in name_ids)
        ids = torch.zeros(len(name_ids), width, dtype=torch.long)
        weights = torch.zeros(len(name_ids), width)
        for i, row in enumerate(name_ids):
            ids[i, : len(row)] = torch.tensor(row)
            weights[i, : len(row)] = 1.0 / len(row)
        self.register_buffer("ids", ids, persistent=False)  # rebuilt from the tokenizer, not checkpointed
        self.register_buffer("weights", weights, persistent=False)

    def forward(self, windows: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        names = (embeddings.detach()[self.ids].float() * self.weights[..., None]).sum(1)
        names = torch.nn.functional.normalize(names, dim=-1)
        x = windows.reshape(windows.shape[0], -1, self.hidden).float()
        x = torch.nn.functional.normalize(x, dim=-1)  # a zero token (off the image) scores 0
        return self.log_scale.exp() * torch.einsum("bth,nh->btn", x, names).amax(1)


class TokenNameHead(torch.nn.Module):
    """The naming loss's head that names from one token (`name_token`): each merged token of the window
    layer-normalised without parameters (as `NameHead`), one linear map of it to the names' logits, and a
    look-alike's logit for a name its best token's among those in its box (`box_window_mask`), so that a
    single token has to carry the whole word."""

    def __init__(self, hidden: int, outputs: int):
        super().__init__()
        self.hidden = hidden
        self.linear = torch.nn.Linear(hidden, outputs)

    def forward(self, windows: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
        x = windows.reshape(windows.shape[0], -1, self.hidden).float()
        logits = self.linear(torch.nn.functional.layer_norm(x, (self.hidden,)))
        return logits.masked_fill(~inside[..., None], float("-inf")).amax(1)


def _name_token_ids(policy: Policy, names: Sequence[str] = NAMES) -> list[list[int]]:
    """Token ids of each of `names` as the instructions write it: the colour or word alone (after a quote)
    and after a space (a link's or a colour's), every token of a form weighted so that each form counts
    once (`TiedNameHead` averages them)."""
    tok = policy.processor.tokenizer
    out = []
    for name in names:
        text = name.removesuffix(" box")
        alone, spaced = (
            tok.encode(text, add_special_tokens=False),
            tok.encode(" " + text, add_special_tokens=False),
        )
        out.append(alone * len(spaced) + spaced * len(alone))  # each form len(alone) * len(spaced) entries
    return out


_NAME_INDEX = {n: i for i, n in enumerate(NAMES)}


_NAME_PUNCT = ".,:;"
"""Trailing punctuation a lorem-ipsum word loses to be named (MiniWoB writes "amet," and "Amet.")."""


@functools.cache
def miniwob_lorem() -> tuple[str, ...]:
    """The lorem-ipsum words of the installed MiniWoB (`ui_utils.lorem_words`: what click-link's links and
    click-button's paragraphs are drawn from), case folded, trailing punctuation dropped, sorted (decision
    "Lorem names")."""
    import miniwob

    path = Path(miniwob.__file__).parent / "html" / "common" / "ui_utils.js"
    found = re.search(r"lorem_words\s*=\s*\[(.*?)\]", path.read_text(encoding="utf-8"), re.S)
    if found is None:
        raise RuntimeError(f"miniwob_lorem: no lorem_words list in {path}")
    return tuple(sorted({w.lower().rstrip(_NAME_PUNCT) for w in json.loads(f"[{found.group(1)}]")}))


@functools.cache
def name_vocab(vocab: str = "fixed") -> tuple[str, ...]:
    """The names the naming head tells apart under a phase's `name_vocab` (decision "Lorem names"): `fixed`,
    `NAMES`; `lorem`, `NAMES` and then every word of `miniwob_lorem` and `LOREM` not among them, sorted."""
    if vocab == "fixed":
        return NAMES
    if vocab != "lorem":
        raise ValueError(f"name_vocab: {vocab!r} is not 'fixed' or 'lorem'")
    return (*NAMES, *sorted((set(miniwob_lorem()) | {w.lower() for w in LOREM}) - set(NAMES)))


@functools.cache
def _name_index(vocab: str) -> dict[str, int]:
    return {n: i for i, n in enumerate(name_vocab(vocab))}


def name_key(e: GroundExample, name: str, vocab: str = "fixed") -> str | None:
    """The name the naming loss gives look-alike `name` of `e` under `vocab`, or None: one of `NAMES` as it
    is, on a synthetic screen; with `lorem`, also a lorem-ipsum word of any screen, case folded and
    without trailing punctuation (decision "Lorem names").

    >>> real = GroundExample(None, "", (0, 0), (0, 0, 1, 1), "miniwob/click-link")
    >>> name_key(real, "Amet,", "lorem"), name_key(real, "Amet,"), name_key(real, "ok", "lorem")
    ('amet', None, None)
    >>> name_key(replace(real, source="synthetic/buttons8"), "ok")
    'ok'
    """
    if e.synthetic and name in _NAME_INDEX:
        return name
    if vocab == "lorem":
        word = name.lower().rstrip(_NAME_PUNCT)
        if word not in _NAME_INDEX and word in _name_index(vocab):
            return word
    return None


def _name_logits(
    policy: Policy, head: torch.nn.Module, examples: Sequence[GroundExample], vocab: str = "fixed"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits for every named look-alike of `examples` (one tower call) and their labels'
    indices in `name_vocab(vocab)`, in the same order: what the naming loss trains and `_name_accuracy`
    scores."""
    named = [[(b, k) for b, n in e.named if (k := name_key(e, n, vocab))] for e in examples]
    images, boxes = [e.image for e in examples], [[b for b, _ in bn] for bn in named]
    if isinstance(head, TokenNameHead):
        logits = head(*window_tokens(policy, images, boxes, inside=True))
    elif isinstance(head, TiedNameHead):
        logits = head(window_tokens(policy, images, boxes), policy.model.get_input_embeddings().weight)
    else:
        logits = head(window_tokens(policy, images, boxes))
    index = _name_index(vocab)
    labels = torch.tensor([index[n] for bn in named for _, n in bn], device=logits.device)
    return logits, labels


def has_names(e: GroundExample, vocab: str = "fixed") -> bool:
    """Whether the naming loss has anything to name on `e`'s screen under `vocab`: a look-alike `name_key`
    names (decision "Naming loss"; an open-vocabulary screen's words are not, but for `lorem`'s, decision
    "Lorem names")."""
    return any(name_key(e, n, vocab) for _, n in e.named)


@torch.no_grad()
def _name_accuracy(
    policy: Policy,
    head: torch.nn.Module,
    heldout: Sequence[GroundExample] | Mapping[str, Sequence[GroundExample]],
    vocab: str = "fixed",
) -> dict:
    """The naming head's accuracy on each held-out set's look-alikes (`<set>/name_acc`; a list: `name_acc`),
    for the sets with something `vocab` names, each screen once (a real screen is the image of several
    targets); the read sets repeat their click set's screens and are skipped."""
    sets = heldout if isinstance(heldout, Mapping) else {"": heldout}
    out = {}
    for name, exs in sets.items():
        exs = [e for e in exs if has_names(e, vocab) and e.answer is None]
        exs = list({id(e.image): e for e in exs}.values())  # one per screen: its examples share `named`
        if not exs:
            continue
        hits = total = 0
        for i in range(0, len(exs), 16):
            logits, labels = _name_logits(policy, head, exs[i : i + 16], vocab)
            hits += int((logits.argmax(-1) == labels).sum())
            total += len(labels)
        out[f"{name}/name_acc" if name else "name_acc"] = round(hits / total, 4)
    return out


# ----------------------------------------------------------------------------------------------------
# Match loss (decision "Match loss")


class MatchHead(torch.nn.Module):
    """The match loss's head: one linear map of a hidden state where the last decoder layer reads it (after
    that layer's input norm) to the names of `name_vocab`, the same map for the click's query position and
    for a look-alike's image tokens."""

    def __init__(self, hidden: int, names: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, names)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.linear(states.float())


@dataclass(frozen=True)
class MatchItems:
    """One screen's states for the match loss: the query positions' (the two that predict the first
    character of x and of y) and each named look-alike's (its image tokens' mean), their names' indices in
    `name_vocab`, which look-alike is the target, and the screen's place in the batch."""

    queries: torch.Tensor
    keys: torch.Tensor
    names: torch.Tensor
    target: int
    example: int


def match_items(
    policy: Policy,
    states: torch.Tensor,
    encoded: Sequence[EncodedSequence],
    examples: Sequence[GroundExample],
    vocab: str,
) -> list[MatchItems]:
    """`MatchItems` of every example of the batch whose reply clicks and whose target `name_key` names under
    `vocab` (the look-alikes it does not name are left out of the keys); `states` are the last layer's
    attention inputs (`_PointCapture.inputs[0]`)."""
    index = _name_index(vocab)
    out = []
    for b, (enc, e) in enumerate(zip(encoded, examples, strict=True)):
        named = [(box, key) for box, n in e.named if (key := name_key(e, n, vocab)) is not None]
        boxes = [box for box, _ in named]
        if e.bbox not in boxes:
            continue
        queries, _ = point_spans(policy, enc, e, first=True)
        if not queries:
            continue
        keys = torch.stack([states[b, box_tokens(policy, enc, box)].float().mean(0) for box in boxes])
        names = torch.tensor([index[key] for _, key in named], device=states.device)
        out.append(MatchItems(states[b, queries].float(), keys, names, boxes.index(e.bbox), b))
    return out


def _match_loss(head: MatchHead, items: Sequence[MatchItems]) -> torch.Tensor | None:
    """Cross-entropy of the head's names for the query positions (the target's name) and for the look-alikes'
    tokens (each its own), the two sides' means averaged; None without an item."""
    if not items:
        return None
    q_logits = head(torch.cat([it.queries for it in items]))
    q_labels = torch.cat([it.names[it.target].repeat(len(it.queries)) for it in items])
    k_logits = head(torch.cat([it.keys for it in items]))
    k_labels = torch.cat([it.names for it in items])
    ce = torch.nn.functional.cross_entropy
    return (ce(q_logits, q_labels) + ce(k_logits, k_labels)) / 2


def match_picks(head: MatchHead, it: MatchItems) -> tuple[bool, float, bool]:
    """What the head reads on one screen, each a pick among the screen's named look-alikes: whether x's
    query names the target (the highest of the look-alikes' names), the share of look-alikes whose tokens
    name themselves, and whether the match (the query's name probabilities dotted with each look-alike's)
    picks the target."""
    q = head(it.queries[:1])[0].softmax(-1)
    k = head(it.keys).softmax(-1)
    own = k[:, it.names].argmax(1) == torch.arange(len(it.names), device=k.device)
    return (
        int(q[it.names].argmax()) == it.target,
        float(own.float().mean()),
        int((k @ q).argmax()) == it.target,
    )


# ----------------------------------------------------------------------------------------------------
# Spelling loss and quoted names (decisions "Spelling loss", "Quoted names")

SPELL_CHARS = string.ascii_lowercase + string.digits
"""What the spelling loss says a word holds: its letters (case folded) and digits."""


def spelled(
    e: GroundExample, scale: tuple[float, float]
) -> list[tuple[tuple[float, float, float, float], str]]:
    """The look-alike words of `e` the spelling loss spells: words, not colours, narrow enough that the
    whole word lies in its `name_window` (`scale`: model px per screen px, x and y), with a letter or digit.

    >>> ex = GroundExample(None, "", (0, 0), (0, 0, 1, 1), "synthetic/openchecks8",
    ...                    named=(((0, 0, 50, 10), "vdtCA"), ((0, 20, 100, 30), "far too wide"), ((0, 0, 9, 9), "red box")))
    >>> spelled(ex, (1.05, 1.07))
    [((0, 0, 50, 10), 'vdtCA')]
    """
    wide = NAME_WINDOW_SCREEN_PX[0] * scale[0]
    if not e.synthetic:  # a real screen's `named` is the naming loss's (decision "Lorem names")
        return []
    return [
        (b, n)
        for b, n in e.named
        if not n.endswith(" box") and b[2] - b[0] <= wide and any(c in SPELL_CHARS for c in n.lower())
    ]


def spell_targets(words: Sequence[str]) -> torch.Tensor:
    """Which of `SPELL_CHARS` each word holds -> (words, len(SPELL_CHARS)) of 0/1.

    >>> spell_targets(["Ab1a"])[0].nonzero().flatten().tolist()
    [0, 1, 27]
    """
    out = torch.zeros(len(words), len(SPELL_CHARS))
    for i, w in enumerate(words):
        for c in set(w.lower()) & set(SPELL_CHARS):
            out[i, SPELL_CHARS.index(c)] = 1.0
    return out


def _spell_logits(
    policy: Policy, head: NameHead, examples: Sequence[GroundExample], scale: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The spelling head's logits for every `spelled` word of `examples` (one tower call) and their
    `spell_targets`; None when no screen has a word to spell."""
    words = [spelled(e, scale) for e in examples]
    keep = [i for i, w in enumerate(words) if w]
    if not keep:
        return None
    windows = window_tokens(
        policy, [examples[i].image for i in keep], [[b for b, _ in words[i]] for i in keep]
    )
    targets = spell_targets([n for i in keep for _, n in words[i]]).to(windows.device)
    return head(windows), targets


def spell_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each character's presence, summed over `SPELL_CHARS` and averaged over the
    words (a word's loss, not a character's: about 25 at the start, so a weight near 0.1-0.25 sets it
    beside the click loss)."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), targets, reduction="sum")
    return bce / logits.shape[0]


@torch.no_grad()
def _spell_measures(
    policy: Policy,
    head: NameHead,
    heldout: Sequence[GroundExample] | Mapping[str, Sequence[GroundExample]],
    scale: tuple[float, float],
) -> dict:
    """The spelling head on each held-out set's words (`<set>/spell_f1`: the F1 of the characters it says
    a word holds, at logit 0, over all the set's words; the read sets repeat their click sets and are
    skipped)."""
    sets = heldout if isinstance(heldout, Mapping) else {"": heldout}
    out = {}
    for name, exs in sets.items():
        exs = [e for e in exs if e.answer is None]
        tp = fp = fn = 0
        for i in range(0, len(exs), 16):
            got = _spell_logits(policy, head, exs[i : i + 16], scale)
            if got is None:
                continue
            said, true = got[0] > 0, got[1] > 0.5
            tp, fp, fn = (
                tp + int((said & true).sum()),
                fp + int((said & ~true).sum()),
                fn + int((~said & true).sum()),
            )
        if tp + fp + fn:
            out[f"{name}/spell_f1" if name else "spell_f1"] = round(2 * tp / (2 * tp + fp + fn), 4)
    return out


def quote_name(e: GroundExample) -> GroundExample:
    """`e` with its thought naming the target as its instruction quotes it (decision "Quoted names"); the
    same example where the instruction quotes nothing or the thought does not end with the name.

    >>> ex = GroundExample(None, 'Click on the "vdtCA" label.', (5, 5), (0, 0, 10, 10), "synthetic/openchecks8",
    ...                    "I will click the label vdtCA.")
    >>> quote_name(ex).thought
    'I will click the label "vdtCA".'
    >>> quote_name(replace(ex, instruction="Check the ok checkbox.")).thought
    'I will click the label vdtCA.'
    """
    name = quoted_name(e.instruction)
    if name is None or not e.thought.endswith(f" {name}."):
        return e
    return replace(e, thought=f'{e.thought[: -len(name) - 1]}"{name}".')


def quoted_name(instruction: str) -> str | None:
    """The name an instruction quotes ('Click on the "vdtCA" label.' -> 'vdtCA'); None where it quotes
    nothing (the colours', links8's and checks8's instructions)."""
    quoted = instruction.split('"')
    return quoted[1] if len(quoted) >= 3 else None


def _carry_heads(path: Path, heads: Mapping[str, torch.nn.Module | None]) -> None:
    """Load each head of `heads` (checkpoint key -> module, None = not trained) from the training checkpoint
    at `path` (decision "Carried heads"); a missing file or head, or one that does not fit, is a ValueError
    naming the file and the head."""
    if not path.exists():
        raise ValueError(f"carry_heads: no checkpoint of the previous phase at {path}")
    state = torch.load(path, weights_only=False)
    names = {key: name for key, name, _, _ in TRAINED_HEADS}
    for key, module in heads.items():
        if module is None:
            continue
        if state.get(key) is None:
            raise ValueError(f"carry_heads: {path} holds no {names[key]} (its phase trained none)")
        try:
            module.load_state_dict(state[key])
        except RuntimeError as e:
            first = str(e).strip().splitlines()[-1].strip()
            raise ValueError(
                f"carry_heads: the {names[key]} in {path} does not fit this phase's: {first}"
            ) from None


def checkpoint_fingerprint(
    config: GroundConfig, system: str, examples: Sequence[GroundExample] | None
) -> str:
    """What a checkpoint must have been made by to be resumed (or snapshotted: pipeline/ground.py, decision
    "Snapshots"): the config, the prompt and the fixed list (its length and targets; its screens are derived
    from the same seeds). Fields at their default are left out, so a field added later, whose default keeps
    the old behaviour, does not orphan a running stage's checkpoints."""
    fixed = [(e.instruction, e.reply) for e in examples or ()]
    defaults = asdict(GroundConfig())
    text = repr((sorted((k, v) for k, v in asdict(config).items() if v != defaults[k]), system, fixed))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------
# Measures (decision "Image dependence metrics")


@torch.no_grad()
def _attention_measures(
    policy: Policy,
    heldout: Sequence[GroundExample] | Mapping[str, Sequence[GroundExample]],
    system: str,
    pattern: float,
    heads: int = 0,
    probe: PlaceProbe | None = None,
    matcher: MatchHead | None = None,
    vocab: str = "fixed",
) -> dict:
    """What the last decoder layer reads on each held-out click set's screens, from one teacher-forced pass
    over the set's own replies (the read sets are skipped):

    - with `heads` > 0, the pointing heads' mean attention mass on the target (`<set>/point_mass`; a list:
      `point_mass`) from the coordinate positions, and on the screen's other look-alikes (`point_other`,
      their tokens that are not the target's; 0 on a screen with none): whether the retrieval was learned,
      apart from whether the click decodes it. A head that found the look-alikes but not the named one
      splits its mass between the two, the target getting `point_even`, the target's share of all the
      look-alikes' tokens (neighbours share cells, so it is above 1 / look-alikes): the chance level of
      `point_mass`. Screens that do not list their look-alikes (real MiniWoB screens) have `point_mass`
      alone. `point_first` is the mass at the two positions that predict the first character of x and of y
      alone: the later positions have read the digits before them, teacher-forced the right ones, so their
      mass can be high without the retrieval (decision "First digits").
    - with a place `probe`, how much of each image token's row and column it reads (`<set>/place_row`,
      `<set>/place_col`: R^2 over the set's image tokens, 1 = exactly, 0 = no better than the grid's
      mean).
    - with a `matcher`, what it reads (`match_picks`, on the set's screens whose target `vocab` names):
      `<set>/match_query` (x's query names the target among the look-alikes), `<set>/match_key` (the
      look-alikes' tokens name themselves) and `<set>/match_pick` (the match through the names picks the
      target)."""
    sets = heldout if isinstance(heldout, Mapping) else {"": heldout}
    out = {}
    policy.model.eval()
    for name, exs in sets.items():
        exs = [e for e in exs if e.answer is None]
        masses: list[float] = []
        first: list[float] = []
        others: list[float] = []
        even: list[float] = []
        preds, truth = [], []
        picks: list[tuple[bool, float, bool]] = []
        for i in range(0, len(exs), 16):
            chunk = exs[i : i + 16]
            encoded = [_encode(policy, e, system, pattern) for e in chunk]
            batch = collate(encoded, policy.pad_id, policy.image_token_id).to(policy.device)
            with _PointCapture(policy, max(heads, 1)) as capture:
                sequence_logprobs(policy.model, batch)
            if probe is not None:
                pred, true = _place_pairs(policy, probe, capture.inputs[0], encoded)
                preds.append(pred)
                truth.append(true)
            if matcher is not None:
                items = match_items(policy, capture.inputs[0], encoded, chunk, vocab)
                picks += [match_picks(matcher, it) for it in items]
            if not heads:
                continue
            spans = _point_spans(policy, encoded, chunk)
            rest, listed = [], []  # listed: the screen lists its look-alikes (a real screen does not)
            for (queries, targets), enc, e in zip(spans, encoded, chunk, strict=True):
                seen = e.named if e.synthetic else ()  # real: look-alikes unlisted
                boxes = [b for b, _ in seen if b != e.bbox]
                tokens = sorted({t for b in boxes for t in box_tokens(policy, enc, b)} - set(targets))
                rest.append(tokens)
                listed.append(bool(queries and seen))
                if listed[-1]:
                    even.append(len(targets) / (len(targets) + len(tokens)))
            queries = [q for q, _ in spans]
            weights = capture.log_weights(queries)
            on_target, on_rest = capture.masses(queries, [t for _, t in spans], rest, weights=weights)
            masses += [m for m in on_target if m == m]
            firsts = [q for q, _ in _point_spans(policy, encoded, chunk, first=True)]
            at_first = capture.at(weights, queries, firsts)
            (on_first,) = capture.masses(firsts, [t for _, t in spans], weights=at_first)
            first += [m for m in on_first if m == m]
            others += [m if m == m else 0.0 for m, keep in zip(on_rest, listed, strict=True) if keep]
        prefix = f"{name}/" if name else ""
        if masses:
            out[prefix + "point_mass"] = round(sum(masses) / len(masses), 4)
            out[prefix + "point_first"] = round(sum(first) / len(first), 4)
        if even:
            out[prefix + "point_other"] = round(sum(others) / len(others), 4)
            out[prefix + "point_even"] = round(sum(even) / len(even), 4)
        if preds:
            pred, true = torch.cat(preds), torch.cat(truth)
            sse = ((pred - true) ** 2).sum(0)
            sst = ((true - true.mean(0)) ** 2).sum(0).clamp(min=1e-12)
            row, col = (1 - sse / sst).tolist()
            out[prefix + "place_row"], out[prefix + "place_col"] = round(row, 4), round(col, 4)
        if picks:
            for k, column in zip(
                ("match_query", "match_key", "match_pick"), zip(*picks, strict=True), strict=True
            ):
                out[prefix + k] = round(sum(map(float, column)) / len(column), 4)
    return out


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson correlation of two equally long sequences; 0.0 when either is constant.

    >>> round(pearson([1, 2, 3], [2, 4, 7]), 4)
    0.9934
    """
    n = len(a)
    if n != len(b) or n < 2:
        raise ValueError(f"pearson needs two sequences of the same length >= 2, got {n} and {len(b)}")
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return 0.0
    return cov / math.sqrt(va * vb)


def _inside(p: tuple[float, float], box: tuple[float, float, float, float]) -> bool:
    return box[0] <= p[0] <= box[2] and box[1] <= p[1] <= box[3]


def click_outcome(
    click: tuple[float, float] | None,
    box: tuple[float, float, float, float],
    others: Sequence[tuple[float, float, float, float]] = (),
) -> tuple[bool, bool]:
    """(hit, other) of one click (None = no click): inside the target's box; else inside one of `others`
    (the screen's other targets: a wrong pick, `GroundMetrics.other_hit_rate`)."""
    hit = click is not None and _inside(click, box)
    return hit, click is not None and not hit and any(_inside(click, o) for o in others)


def best_constant_click(
    boxes: Sequence[tuple[float, float, float, float]],
    candidates: Sequence[tuple[float, float]] | None = None,
) -> tuple[tuple[float, float], float]:
    """The image-blind ceiling: the one point inside the most target boxes -> (point, hit rate).

    Candidates default to every box centre and corner (an optimum of a point-in-boxes count is always
    attained at an intersection of box edges; those lie in this set only approximately, so this is a
    lower bound of the exact ceiling that is exact for nested or disjoint boxes).
    """
    if not boxes:
        raise ValueError("best_constant_click needs at least one box")
    if candidates is None:
        xs = sorted({v for b in boxes for v in (b[0], b[2])})
        ys = sorted({v for b in boxes for v in (b[1], b[3])})
        candidates = [(x, y) for x in xs for y in ys]
    best, best_hits = candidates[0], -1
    for c in candidates:
        hits = sum(_inside(c, b) for b in boxes)
        if hits > best_hits:
            best, best_hits = c, hits
    return best, best_hits / len(boxes)


@dataclass(frozen=True)
class GroundMetrics:
    """Image-dependence measures on a held-out set (all coordinates in model-image pixels)."""

    n: int
    """Examples evaluated."""
    parse_rate: float
    """Replies that parse to a click."""
    mean_err_px: float
    """Mean Euclidean distance of the click to the target centre (unparsed replies count as the
    centre of the image)."""
    hit_rate: float
    """Clicks inside the target box."""
    corr_x: float
    """Pearson correlation of predicted and target x."""
    corr_y: float
    """Pearson correlation of predicted and target y."""
    spread_px: float
    """sqrt(var(x) + var(y)) of the clicks: 0 for an image-blind constant click."""
    blind_err_px: float
    """Mean error of the best image-blind constant click for mean error (the mean target)."""
    blind_hit_rate: float
    """Hit rate of the best image-blind constant click (best_constant_click)."""
    coord_nll: float = float("nan")
    """Teacher-forced NLL (nats) of the coordinate digits of the correct reply, summed over one reply's
    digits and averaged over examples: falls below the blind prior's entropy before greedy clicks move."""
    other_hit_rate: float = 0.0
    """Clicks inside another target of the screen and not the named one (`GroundExample.lookalikes`): the
    model pointed at a target but picked the wrong one. 1 - hit_rate - other_hit_rate missed every target
    (a point between them, or off). 0 where no example lists other targets (one target on the screen)."""

    def as_dict(self) -> dict[str, float]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def grounding_metrics(
    clicks: Sequence[tuple[float, float] | None],
    targets: Sequence[tuple[float, float]],
    boxes: Sequence[tuple[float, float, float, float]],
    image_size: tuple[int, int] = (168, 224),
    others: Sequence[Sequence[tuple[float, float, float, float]]] | None = None,
) -> GroundMetrics:
    """Measures of decision "Image dependence metrics" from predicted clicks (None = unparsable reply), target
    centres and boxes, and with `others` (each example's other targets' boxes) the wrong picks."""
    n = len(targets)
    if not (n == len(clicks) == len(boxes)) or n < 2:
        raise ValueError("clicks, targets and boxes need the same length >= 2")
    centre = (image_size[0] / 2, image_size[1] / 2)
    pts = [c if c is not None else centre for c in clicks]
    err = [math.dist(p, t) for p, t in zip(pts, targets, strict=True)]
    mx = sum(t[0] for t in targets) / n
    my = sum(t[1] for t in targets) / n
    px = [p[0] for p in pts]
    py = [p[1] for p in pts]
    mpx, mpy = sum(px) / n, sum(py) / n
    spread = math.sqrt(sum((x - mpx) ** 2 for x in px) / n + sum((y - mpy) ** 2 for y in py) / n)
    outcomes = [click_outcome(c, b, os) for c, b, os in zip(clicks, boxes, others or [()] * n, strict=True)]
    return GroundMetrics(
        n=n,
        parse_rate=sum(c is not None for c in clicks) / n,
        mean_err_px=sum(err) / n,
        hit_rate=sum(hit for hit, _ in outcomes) / n,
        corr_x=pearson(px, [t[0] for t in targets]),
        corr_y=pearson(py, [t[1] for t in targets]),
        spread_px=spread,
        blind_err_px=sum(math.dist((mx, my), t) for t in targets) / n,
        blind_hit_rate=best_constant_click(boxes)[1],
        other_hit_rate=sum(other for _, other in outcomes) / n,
    )


def first_click(text: str) -> tuple[float, float] | None:
    """The point of the first click-like action of a reply (None if it does not parse or has none).

    >>> first_click("Thought: x\\nAction: click(start_box='(3,4)')")
    (3.0, 4.0)
    """
    try:
        parsed = parse_response(text)
    except ActionParseError:
        return None
    for a in parsed.actions:
        if a.point is not None:
            return (float(a.point[0]), float(a.point[1]))
    return None


def greedy_replies(
    policy: Policy,
    examples: Sequence[GroundExample],
    *,
    system: str,
    max_new_tokens: int,
    batch_size: int = 32,
    readout: str = "tokens",
) -> list[str]:
    """`policy`'s greedy replies (at most `max_new_tokens` tokens each) to the examples' screens and
    instructions, their clicks written by `readout` (params' `policy.click_readout`)."""
    from arpo_core.policy.generate import HFGenerator

    gen = HFGenerator(policy, spec=PromptSpec(system, None), click_readout=readout)
    texts: list[str] = []
    for i in range(0, len(examples), batch_size):
        outs = gen.generate(
            [PromptInput(e.instruction, (e.image,)) for e in examples[i : i + batch_size]],
            temperature=0.0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
        )
        texts += [o.text for o in outs]
    return texts


def copies(e: GroundExample, reply: str) -> bool | None:
    """Whether `reply`'s thought says the name `e`'s instruction quotes (case folded); None where the
    instruction quotes nothing (decision "Open vocabulary").

    >>> ex = GroundExample(None, 'Click on the "EiTE" label.', (5, 5), (0, 0, 10, 10), "miniwob/click-checkboxes")
    >>> copies(ex, "Thought: I will click the label Eim. Action: click(start_box='(5,5)')")
    False
    """
    name = quoted_name(e.instruction)
    return None if name is None else name.lower() in reply.split("Action:")[0].lower()


def hits_by_target(examples: Sequence[GroundExample], replies: Sequence[str]) -> dict[str, dict[str, float]]:
    """Greedy replies' hits grouped by task and target kind, `<task>/<kind>` (decision "Real targets by
    kind") -> {group: {n, hit_rate, other_hit_rate, copy_rate}}: other_hit_rate, the click in another
    target's box; copy_rate, the thought says the instruction's quoted name (decision "Open vocabulary").

    >>> ex = GroundExample(None, 'Click on the "Amet." link.', (5, 5), (0, 0, 10, 10), "miniwob/click-link",
    ...                    lookalikes=((20, 0, 30, 10),), kind="link")
    >>> said, other = "Thought: I will click the link amet..", "Thought: I will click the link Suget."
    >>> hits_by_target([ex, ex], [said + " Action: click(start_box='(5,5)')", other + " Action: click(start_box='(25,5)')"])
    {'click-link/link': {'n': 2, 'hit_rate': 0.5, 'other_hit_rate': 0.5, 'copy_rate': 0.5}}
    """
    groups: dict[str, list[tuple[bool, bool, bool]]] = {}
    for e, reply in zip(examples, replies, strict=True):
        hit, other = click_outcome(first_click(reply), e.bbox, e.lookalikes)
        copied = bool(copies(e, reply))
        task = e.source.partition("/")[2]
        groups.setdefault(f"{task}/{e.kind or 'target'}", []).append((hit, other, copied))
    return {
        g: {
            "n": len(v),
            "hit_rate": sum(h for h, _, _ in v) / len(v),
            "other_hit_rate": sum(o for _, o, _ in v) / len(v),
            "copy_rate": sum(c for _, _, c in v) / len(v),
        }
        for g, v in sorted(groups.items())
    }


def evaluate_grounding(
    policy: Policy,
    examples: Sequence[GroundExample],
    *,
    system: str,
    max_new_tokens: int,
    batch_size: int = 32,
    pattern: float = 0.0,
    clicks: list[tuple[float, float] | None] | None = None,
    readout: str = "tokens",
) -> GroundMetrics:
    """Greedy replies (at most `max_new_tokens` tokens, clicks written by `readout`) of `policy` on
    `examples` -> GroundMetrics. `clicks`: when given, those replies' first clicks, already decoded
    (`first_click`)."""
    size = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
    if pattern > 0:
        examples = [replace(e, image=coord_pattern(e.image, size, pattern)) for e in examples]
    if clicks is None:
        replies = greedy_replies(
            policy,
            examples,
            system=system,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            readout=readout,
        )
        clicks = [first_click(text) for text in replies]
    nll = coordinate_nll(policy, examples, system=system, batch_size=batch_size)
    others = [e.lookalikes for e in examples]
    m = grounding_metrics(clicks, [e.target for e in examples], [e.bbox for e in examples], size, others)
    return replace(m, coord_nll=nll)


def evaluate_reading(
    policy: Policy, examples: Sequence[GroundExample], *, system: str, max_new_tokens: int
) -> float:
    """Mean `read_score` of `policy`'s greedy replies on reading examples (decision "Reading examples")."""
    replies = greedy_replies(policy, examples, system=system, max_new_tokens=max_new_tokens)
    return sum(read_score(t, e.answer or "") for t, e in zip(replies, examples, strict=True)) / max(
        len(examples), 1
    )


@torch.no_grad()
def coordinate_nll(
    policy: Policy, examples: Sequence[GroundExample], *, system: str, batch_size: int = 32
) -> float:
    """Mean over examples of the summed NLL of the digit tokens after `start_box` in the reply
    (teacher-forced, fp32). Images are used as given (apply any pattern before)."""
    digit_ids = {i for t, i in policy.tokenizer.get_vocab().items() if len(t) == 1 and t.isdigit()}
    total, n = 0.0, 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        seqs = [_encode(policy, e, system) for e in chunk]
        batch = collate(seqs, policy.pad_id, policy.image_token_id).to(policy.device)
        logps, mask = sequence_logprobs(policy.model, batch)  # (B, T) each
        is_digit = torch.zeros_like(mask)
        for d in digit_ids:
            is_digit |= batch.input_ids == d
        total += float(-(logps * (mask & is_digit)).sum())
        n += len(chunk)
    return total / max(n, 1)


def image_dependence(
    policy: Policy, examples: Sequence[GroundExample], *, system: str, max_new_tokens: int
) -> dict[str, float]:
    """The image-dependence summary reported beside success rates (docs/method.md §7)."""
    return evaluate_grounding(policy, examples, system=system, max_new_tokens=max_new_tokens).as_dict()
