"""Prompts and trajectories -> token sequences with image inputs; per-token log-probs in one padded forward.

Decisions:
- **One sequence per trajectory.** One multi-turn trajectory is ONE sequence (docs/method.md §1): system +
  instruction, then screenshot, reply, screenshot, reply... The assistant mask covers each reply's tokens and
  its `<|im_end|>`, nothing else (not the chat markup, not the images), and only the replies of steps with
  `train_reply` set: a step with `train_reply = False` (a recovery demo's deliberate miss,
  arpo_core/offline/demonstrations.py) stays in the sequence as context - the later replies are conditioned on
  it - but is never a target, neither for behaviour cloning nor for a policy-gradient loss. Rollout steps
  always have it set.
- **Shared encoding.** Generation prompts and training sequences are encoded by the same function from the
  same segments (prompt.py), so a generated step's prompt is token for token a prefix of the trajectory's
  sequence. A reply with known `response_token_ids` (sampled) is used verbatim; otherwise its text is
  tokenised and `<|im_end|>` appended. A sampled reply cut at max_new_tokens gets `<|im_end|>` appended to
  close the turn, but that token is outside the mask: it was never sampled, so it has no behaviour log-prob.
- **History windows.** History window K (`history_images`): None = every screenshot, which the ARPO reference
  uses (all, up to 15) and under which one sequence reproduces every step's context exactly. With K < n steps
  one sequence cannot: step t saw the screenshots t-K+1..t, a sequence of the whole episode holds the last
  K, so with K = 1 every earlier reply would be scored and trained with no screenshot at all (an
  image-blind update of the clicks that were chosen looking at one). `encode_trajectory_windows` then
  encodes the episode as n - K + 1 sequences: the first ends at step K-1 (its replies all have their
  exact context), each later one ends at step t and trains only reply t, the earlier replies being
  context; so every trained reply is scored in the context it was generated in, token for token the
  generation prompt plus the reply. The cost is one forward per window instead of one per episode.
  The loss treats a trajectory's windows as that trajectory (update.py, decision "Windowed trajectories";
  behaviour_cloning.py, decision "Token-mean NLL" needs nothing: a token-mean over windows is the token-mean
  over the trajectory).
- **M-RoPE token types.** `mm_token_type_ids = (input_ids == image_token_id)` goes into every hand-built
  forward: transformers 5.x builds Qwen2.5-VL's 3-D (t, h, w) M-RoPE positions only when it is given; without
  it training silently uses 1-D positions while generation uses 3-D ones (docs/method.md §7). Qwen3-VL takes
  the same input for its own (interleaved) positions and refuses a multimodal forward without it
  (docs/models.md); every function here serves both families unchanged.
- **Padding sides.** Training batches are right-padded, generation batches left-padded; both carry an
  attention mask and the positions are computed per row over its unpadded tokens, so padding changes nothing.
- **Raw-logit log-probs.** Log-probs are of the raw logits at temperature 1 unless a temperature is given:
  that is what GRPO's old/new log-probs use (the trainer recomputes old_logps, docs/method.md §1), and what
  `generate.py` reports as the behaviour log-probs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from arpo_core.policy.model import Policy, image_inputs
from arpo_core.policy.prompt import PromptInput, PromptSpec, Reply, Segment, build_segments
from arpo_core.trajectory import Trajectory

__all__ = [
    "EncodedSequence",
    "SequenceBatch",
    "collate",
    "encode_prompt",
    "encode_segments",
    "encode_trajectory",
    "encode_trajectory_windows",
    "forward_logits",
    "gather_logprobs",
    "reply_ids",
    "reply_logprob_sums",
    "sequence_logprobs",
]


@dataclass
class EncodedSequence:
    """One tokenised sequence with its images."""

    input_ids: list[int]
    assistant_mask: list[bool]
    """True at tokens the policy is trained on (reply tokens and their `<|im_end|>`)."""
    pixel_values: torch.Tensor | None
    """(P, C*2*14*14) flattened patches of this sequence's images, in order; None without images."""
    image_grid_thw: torch.Tensor | None
    """(N_images, 3) patch grid (t, h, w) per image."""
    source: int | None = None
    """The trajectory this sequence belongs to, as an index into the list `update.encode_trajectories`
    was given (a trajectory split into windows, decision "History windows", has several sequences); None: its
    own."""


@dataclass
class SequenceBatch:
    """A padded batch; tensor shapes in the field docs."""

    input_ids: torch.Tensor
    """(B, T) long, padded with the pad id."""
    attention_mask: torch.Tensor
    """(B, T) long, 1 on real tokens."""
    assistant_mask: torch.Tensor
    """(B, T) bool, True on trained tokens."""
    pixel_values: torch.Tensor | None
    """(P, D) all images' patches, batch row by row."""
    image_grid_thw: torch.Tensor | None
    """(N, 3)."""
    mm_token_type_ids: torch.Tensor
    """(B, T) int: 1 at image placeholder tokens, 0 elsewhere (docs/method.md §7)."""

    def to(self, device: torch.device | str) -> SequenceBatch:
        def mv(t):
            return None if t is None else t.to(device)

        return SequenceBatch(*(mv(getattr(self, f)) for f in self.__dataclass_fields__))


def reply_ids(policy: Policy, reply: Reply) -> tuple[list[int], list[bool]]:
    """A reply's token ids as trained on, its closing `<|im_end|>` included, and which of them are
    targets (decision "One sequence per trajectory"): sampled ids verbatim, otherwise the tokenised text."""
    im_end = policy.im_end_id
    if reply.token_ids:
        ids = list(reply.token_ids)
        mask = [True] * len(ids)
        if ids[-1] != im_end:  # cut at max_new_tokens: close the turn, but it was never sampled
            ids.append(im_end)
            mask.append(False)
        return ids, mask
    ids = [*policy.tokenizer.encode(reply.text, add_special_tokens=False), im_end]
    return ids, [True] * len(ids)


def encode_segments(
    policy: Policy,
    segments: Sequence[Segment],
    screenshots: Sequence[Image.Image],
    *,
    context_replies: Collection[int] = (),
) -> EncodedSequence:
    """Tokenise segments; `screenshots[s.step]` is the image of an image segment. The replies of the steps
    in `context_replies` are tokenised but kept out of the assistant mask
    (decision "One sequence per trajectory").

    Each image becomes `grid_h * grid_w / merge**2` copies of `<|image_pad|>` (the image processor's
    smart_resize decides the grid).
    """
    steps = [s.step for s in segments if s.kind == "image"]
    pixel_values = grid = None
    n_tokens: list[int] = []
    if steps:
        shown = policy.model_images([screenshots[i] for i in steps])  # blank for the image-blind arm
        pixel_values, grid = image_inputs(policy.image_processor, shown)
        merge = policy.image_processor.merge_size
        n_tokens = (grid.prod(-1) // (merge * merge)).tolist()
    ids: list[int] = []
    mask: list[bool] = []
    img = 0
    for s in segments:
        if s.kind == "text":
            part = policy.text_ids(s.text)
            part_mask = [False] * len(part)
        elif s.kind == "image":
            part = [policy.image_token_id] * n_tokens[img]
            part_mask = [False] * len(part)
            img += 1
        else:
            part, part_mask = reply_ids(policy, s.reply)
            if s.step in context_replies:
                part_mask = [False] * len(part)
        ids += part
        mask += part_mask
    return EncodedSequence(ids, mask, pixel_values, grid)


def encode_prompt(policy: Policy, prompt: PromptInput, *, spec: PromptSpec) -> EncodedSequence:
    """The generation prompt of one step (ends with `<|im_start|>assistant\\n`; earlier replies masked)."""
    segs = build_segments(
        prompt.instruction,
        len(prompt.screenshots),
        prompt.replies,
        spec=spec,
    )
    return encode_segments(policy, segs, prompt.screenshots)


def encode_trajectory(policy: Policy, traj: Trajectory, *, spec: PromptSpec) -> EncodedSequence:
    """A whole trajectory as one sequence (decision "One sequence per trajectory"): every reply is in it, and
    the assistant mask covers those of the steps with `train_reply` set. Each reply has its exact context only
    when every screenshot fits the window (K None or n <= K); training encodes with
    `encode_trajectory_windows`."""
    replies = [Reply(s.response_text, tuple(s.response_token_ids or ())) for s in traj.steps]
    segs = build_segments(traj.instruction, len(traj.steps), replies, spec=spec)
    context = {k for k, s in enumerate(traj.steps) if not s.train_reply}
    return encode_segments(policy, segs, [s.image() for s in traj.steps], context_replies=context)


def encode_trajectory_windows(policy: Policy, traj: Trajectory, *, spec: PromptSpec) -> list[EncodedSequence]:
    """The trajectory as training sequences in which every trained reply has the exact context it was
    generated in (decision "History windows"): one sequence when all its screenshots fit the window (K None or
    n <= K), otherwise one for steps 0..K-1 and one per later step; windows with no trained reply are left
    out. Every trained reply is a target in exactly one window."""
    n, history_images = len(traj.steps), spec.history_images
    if history_images is None or n <= history_images:
        return [encode_trajectory(policy, traj, spec=spec)]
    replies = [Reply(s.response_text, tuple(s.response_token_ids or ())) for s in traj.steps]
    shots = [s.image() for s in traj.steps]
    untrained = {k for k, s in enumerate(traj.steps) if not s.train_reply}
    out: list[EncodedSequence] = []
    for end in range(history_images - 1, n):
        targets = set(range(end + 1)) if end == history_images - 1 else {end}
        if not targets - untrained:
            continue
        segs = build_segments(traj.instruction, end + 1, replies[: end + 1], spec=spec)
        context = set(range(end + 1)) - (targets - untrained)
        out.append(encode_segments(policy, segs, shots[: end + 1], context_replies=context))
    return out


def collate(
    seqs: Sequence[EncodedSequence],
    pad_id: int,
    image_token_id: int,
    padding_side: str = "right",
    shared_head: int = 0,
) -> SequenceBatch:
    """Pad to the longest sequence (right for training, left for generation) and concatenate images.

    `shared_head` > 0 (left padding only): the first `shared_head` tokens, the same in every row, stay in
    the first columns and the padding goes between them and each row's rest, so one forward of the head
    serves every row (generate.py, decision "Shared prompt head")."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    h = shared_head
    if h:
        if padding_side != "left":
            raise ValueError("a shared head needs left padding")
        head = seqs[0].input_ids[:h]
        if len(head) < h or any(s.input_ids[:h] != head for s in seqs):
            raise ValueError(f"the rows do not share their first {h} tokens")
    T = h + max(len(s.input_ids) - h for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    assistant = torch.zeros((B, T), dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        if padding_side == "right":
            parts = [(slice(0, n), slice(0, n))]
        else:  # the shared head (none when h = 0) in the first columns, the rest against the right edge
            parts = [(slice(0, h), slice(0, h)), (slice(h, n), slice(T - (n - h), T))]
        for src, dst in parts:
            if src.stop > src.start:
                input_ids[b, dst] = torch.tensor(s.input_ids[src], dtype=torch.long)
                attention[b, dst] = 1
                assistant[b, dst] = torch.tensor(s.assistant_mask[src], dtype=torch.bool)
    pix = [s.pixel_values for s in seqs if s.pixel_values is not None]
    grids = [s.image_grid_thw for s in seqs if s.image_grid_thw is not None]
    mm = ((input_ids == image_token_id) & attention.bool()).to(torch.int)
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention,
        assistant_mask=assistant,
        pixel_values=torch.cat(pix) if pix else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        mm_token_type_ids=mm,
    )


def forward_logits(
    model: torch.nn.Module, batch: SequenceBatch, logits_to_keep: int | torch.Tensor = 0
) -> torch.Tensor:
    """Logits (B, T, V) of a full (no cache) forward, with 3-D M-RoPE positions
    (decision "M-RoPE token types"); with `logits_to_keep` only at those positions (transformers' meaning:
    n > 0 the last n, a 1-D tensor those positions; 0 all)."""
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        mm_token_type_ids=batch.mm_token_type_ids,
        use_cache=False,
        logits_to_keep=logits_to_keep,
    ).logits


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] without materialising the full log-softmax.

    logits (..., V), targets (...) long -> (...) float32.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(
    model: torch.nn.Module, batch: SequenceBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of a padded batch.

    Returns `logps` (B, T): logps[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) at assistant tokens,
    0 elsewhere, and `mask` (B, T) bool: the assistant tokens (where logps is meaningful and trained).
    The vocabulary projection runs only at positions that predict an assistant token of some row
    (`logits_to_keep` as 1-D positions), so memory does not scale with T x V (UI-TARS: 152k vocabulary,
    thousands of image tokens). The call goes through `model(...)`, so a wrapper such as a DeepSpeed
    engine (ZeRO-3 gathers weights in its forward hooks) can be passed as `model`.
    """
    mask = batch.assistant_mask & batch.attention_mask.bool()
    mask[:, 0] = False
    predicts = mask[:, 1:]  # (B, T-1): the hidden state at t predicts token t+1
    keep = predicts.any(0).nonzero().squeeze(-1)  # (K,) positions needed by any row
    logits = forward_logits(model, batch, keep)  # (B, K, V)
    picked = gather_logprobs(logits, batch.input_ids[:, keep + 1], temperature)  # (B, K)
    picked = picked.masked_fill(~predicts[:, keep], 0.0)
    B, T = batch.input_ids.shape
    logps = torch.zeros((B, T), dtype=torch.float32, device=logits.device).index_copy(1, keep + 1, picked)
    return logps, mask


def reply_logprob_sums(assistant_mask: Sequence[bool], logps: torch.Tensor) -> list[tuple[float, int]]:
    """(sum of log-probs, tokens) of each trained reply of one sequence: the runs of consecutive assistant
    tokens in order (a reply's sampled tokens are one run; chat markup separates two replies).
    `logps` (L,) as `update.compute_logps` returns them. The trainer compares these sums with the
    generator's `gen_logprob_sum` of the same steps (trainer.py, the `logprob/*` diagnostic)."""
    out: list[tuple[float, int]] = []
    run_sum, run_len = 0.0, 0
    for t, on in enumerate(assistant_mask):
        if on and t > 0:
            run_sum += float(logps[t])
            run_len += 1
        elif run_len:
            out.append((run_sum, run_len))
            run_sum, run_len = 0.0, 0
    if run_len:
        out.append((run_sum, run_len))
    return out
