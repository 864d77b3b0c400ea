"""The language model's last-layer attention heads, read: which screen cells a reply position attends to,
and the click they point at (`pointed`, `Pointed.click`; generation may take its clicks from it with
`policy.click_readout`, decision "Clicks read from the pointing head"). The ground stage trains and
measures its pointing heads with this (arpo_core/offline/grounding.py, decision "Pointing loss"), and
behaviour cloning teaches them the demos' clicks with it (`click_targets`;
arpo_core/offline/behaviour_cloning.py, decision "Pointing loss").

Decisions:
- **Weights recomputed from the layer's inputs.** A head's attention weights are recomputed from the inputs
  of the layer's attention kept by a hook (`AttentionInputs`): the layer's own q/k projections, q/k norms
  where the family has them (Qwen3-VL), its rotary embedding and scaling, a softmax over the causal prefix
  (`HeadWeights`). So they are the weights the layer uses whatever attention kernel the model runs (SDPA
  and flash kernels return none), in fp32 even inside a bf16 forward, and differentiable for a loss.
- **Clicks read from the pointing head.** At the position that predicts the first character of a click's x
  (the one that has read no digit of it), the first `heads` heads of the last layer, averaged, over the
  current screenshot's cells (its merged tokens, `image_cells`); the click is the cell with the most mass
  (`cell`: its centre) or the mass-weighted mean of the cell centres in the 3x3 block around it (`block`), in
  the model frame's pixels; or (`guarded`) the written click where it lies in that cell or one of its 8
  neighbours, the cell's centre elsewhere: the head vetoes digits that point far from what it attends, and
  where the two agree the digits keep their sub-cell precision. The head is taught on prompts that name one
  target: where an instruction names several in an order (click-checkboxes' "Select a, b and click Submit"),
  it reads one fixed cell and every readout loses to the digits (docs/results.md, "The readout in the main
  job"); behaviour cloning may teach it the demos' clicks in their order (`sft.point_weight`,
  arpo_core/offline/behaviour_cloning.py, decision "Pointing loss"). This is GUI-Actor's idea (an action head
  that attends over the screen's patches instead of writing digits) with the policy's own pointing head and no
  new parameters. The ground stage's pointing loss teaches head 0 to put its mass on the named target at those
  positions; measured on the 2x reader (docs/results.md, "Clicks read from the pointing head"), the head has
  the named widget more often than the digits that follow it hit it, and at 2x a cell (28 model px, 13 screen
  px) is smaller than the targets. At 1x a cell is 28 screen px, larger than most targets, and the read click
  loses to the written one.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from arpo_core.policy.model import Policy
from arpo_core.policy.sequences import EncodedSequence, collate, forward_logits

__all__ = [
    "READOUTS",
    "AttentionInputs",
    "HeadWeights",
    "Pointed",
    "cell_click",
    "cell_size",
    "click_positions",
    "click_targets",
    "image_cells",
    "image_runs",
    "pointed",
    "reply_runs",
]

READOUTS = ("cell", "block", "guarded")
"""The click readouts: the cell with the most mass, its 3x3 block's weighted centre, or the written click
where it lies in that cell's 3x3 block and the cell's centre elsewhere (decision "Clicks read from the
pointing head")."""


def reply_runs(enc: EncodedSequence) -> list[list[int]]:
    """The positions of each run of assistant tokens in `enc` (a trained reply and its `<|im_end|>`), in
    order."""
    runs: list[list[int]] = []
    for i, on in enumerate(enc.assistant_mask):
        if on:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    return runs


def _click_chars(
    policy: Policy, ids: Sequence[int], reply: Sequence[int], first: bool
) -> tuple[list[int], str] | None:
    """`click_positions` for the reply at positions `reply`, with the text between `start_box='(` and its
    `)` ("" without the `)`); None where the decoded reply has no `start_box='(`."""
    tok = policy.processor.tokenizer
    pieces = [tok.decode([ids[i]]) for i in reply]
    text, starts = "", []
    for piece in pieces:
        starts.append(len(text))
        text += piece
    begin = text.find("start_box='(")
    if begin < 0:
        return None
    begin += len("start_box='(")
    end = text.find(")", begin)
    if first:
        comma = text.find(",", begin, end)
        chars = (begin, comma + 1) if comma >= 0 else (begin,)
        at = [k for k, a in enumerate(starts) if any(a <= c < a + len(pieces[k]) for c in chars)]
    else:
        at = [k for k, a in enumerate(starts) if a < end and a + len(pieces[k]) > begin]
    return [reply[k] - 1 for k in at], text[begin:end] if end >= 0 else ""  # a cut reply: no point


def click_positions(policy: Policy, enc: EncodedSequence, first: bool = False) -> list[int] | None:
    """The positions of `enc` whose next token is a character of its reply's click coordinates (inside
    `start_box='(...)`), or with `first` the two that predict x's and y's first characters; [] without a
    reply, None where the reply's decoded tokens have no `start_box='(`. The reply is the first run of
    assistant tokens."""
    runs = reply_runs(enc)
    if not runs:
        return []
    found = _click_chars(policy, enc.input_ids, runs[0], first)
    return None if found is None else found[0]


def cell_size(policy: Policy) -> int:
    """The side of a merged image token's cell in model pixels (`patch_size * merge_size`: 28 for
    Qwen2.5-VL)."""
    proc = policy.processor.image_processor
    return int(proc.patch_size) * int(proc.merge_size)


def image_runs(policy: Policy, enc: EncodedSequence) -> list[tuple[list[int], int, int]]:
    """Per screenshot of `enc`, in order: (the positions of its merged image tokens in raster order, the
    token grid's rows, its columns) (the tokens the language model gets, in the processor's order: rows of
    merged cells, top to bottom)."""
    if enc.image_grid_thw is None:
        return []
    merge = int(policy.processor.image_processor.merge_size)
    tokens = [i for i, t in enumerate(enc.input_ids) if t == policy.image_token_id]
    out, at = [], 0
    for thw in enc.image_grid_thw.tolist():
        _, gh, gw = (int(v) for v in thw)
        rows, cols = gh // merge, gw // merge
        out.append((tokens[at : at + rows * cols], rows, cols))
        at += rows * cols
    return out


def image_cells(policy: Policy, enc: EncodedSequence) -> tuple[list[int], int, int]:
    """(positions, rows, columns) of `enc`'s last screenshot (the current screen of a prompt with history),
    as `image_runs` gives them; ([], 0, 0) without an image."""
    runs = image_runs(policy, enc)
    return runs[-1] if runs else ([], 0, 0)


_POINT = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*$")


def click_targets(policy: Policy, enc: EncodedSequence) -> list[tuple[list[int], list[int]]]:
    """The pointing loss's spans in a trajectory sequence (arpo_core/offline/behaviour_cloning.py, decision
    "Pointing loss"): for each trained reply whose click is a point `(x,y)` on its screen, (the two positions
    that predict the first character of x and of y, [the merged image token whose cell holds the point, in
    the last screenshot before the reply]). A reply without a click, or whose point is off its screen, has
    none."""
    unit = cell_size(policy)
    images = [im for im in image_runs(policy, enc) if im[0]]
    out = []
    for run in reply_runs(enc):
        found = _click_chars(policy, enc.input_ids, run, first=True)
        shown = [im for im in images if im[0][0] < run[0]]
        point = _POINT.match(found[1]) if found is not None else None
        if point is None or not shown or not found[0]:
            continue
        cells, rows, cols = shown[-1]
        r, c = int(float(point[2]) // unit), int(float(point[1]) // unit)
        if 0 <= r < rows and 0 <= c < cols:
            out.append((found[0], [cells[r * cols + c]]))
    return out


class AttentionInputs:
    """Within the block, the inputs of the chosen decoder layers' attention are kept from each forward:
    `kept[d]` = (hidden states, as layer d's attention reads them: after its input norm; rotary (cos, sin)),
    for each d of `layers` (negative counts from the last layer)."""

    def __init__(self, policy: Policy, layers: Sequence[int] = (-1,)):
        self.layers = policy.model.model.language_model.layers
        self.chosen = sorted({d % len(self.layers) for d in layers})
        self.kept: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hooks: list = []

    def __enter__(self):
        def keep(d):
            def hook(module, args, kwargs):
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                self.kept[d] = (hidden, kwargs["position_embeddings"])

            return hook

        self._hooks = [
            self.layers[d].self_attn.register_forward_pre_hook(keep(d), with_kwargs=True) for d in self.chosen
        ]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class HeadWeights(AttentionInputs):
    """Within the block, the inputs of the last decoder layer's attention (hidden states and rotary
    cos/sin) are kept from each forward (`inputs`), so that `log_weights` recomputes the attention weights
    of its first `heads` query heads at a few query positions exactly as the layer does (decision "Weights
    recomputed from the layer's inputs")."""

    def __init__(self, policy: Policy, heads: int = 1):
        super().__init__(policy, (-1,))
        self.attn = self.layers[-1].self_attn
        n = policy.model.config.text_config.num_attention_heads
        if not 1 <= heads <= n:
            raise ValueError(f"point_heads must be in [1, {n}] for this model, got {heads}")
        self.heads = heads

    @property
    def inputs(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
        return self.kept.get(self.chosen[0])

    def log_weights(self, queries: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per row b, the log of the heads' attention weights (heads x len(queries[b]), T) at those
        positions, head by head."""
        attn = self.attn
        hidden, (cos, sin) = self.inputs
        with torch.autocast(hidden.device.type, enabled=False):  # in fp32, even inside a bf16 forward
            return self._log_weights(queries, attn, hidden.float(), cos.float(), sin.float())

    def point_terms(self, rows: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]]) -> torch.Tensor:
        """The pointing loss's terms: -log of a head's attention mass on the target tokens, one per head and
        query position of each span (query positions, target positions) of each row (`rows[b]`: row b's
        spans), in log space so that a head that starts far from the target still gets its gradient; a span
        without queries or targets has none. 1-D, in fp32."""
        queries = [[q for span, _ in spans for q in span] for spans in rows]
        terms = []
        for w, spans, pos in zip(self.log_weights(queries), rows, queries, strict=True):
            if not pos:
                continue
            w = w.view(self.heads, len(pos), -1)
            at = 0
            for span, targets in spans:
                if span and targets:
                    terms.append(
                        -torch.logsumexp(w[:, at : at + len(span)][..., list(targets)], dim=-1).reshape(-1)
                    )
                at += len(span)
        return torch.cat(terms) if terms else self.inputs[0].new_zeros((0,)).float()

    def _log_weights(self, queries, attn, hidden, cos, sin) -> list[torch.Tensor]:
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        hd = attn.head_dim
        H = self.heads
        kv = (H - 1) // attn.num_key_value_groups + 1  # the key heads the first H query heads read
        B, T, _ = hidden.shape
        q = attn.q_proj(hidden)[..., : H * hd].view(B, T, H, hd)
        k = attn.k_proj(hidden)[..., : kv * hd].view(B, T, kv, hd)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3-VL normalises q and k per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, hd), (B, kv, T, hd)
        k = k.repeat_interleave(attn.num_key_value_groups, dim=1)[:, :H]  # query head h reads key h // groups
        out = []
        for b, pos in enumerate(queries):
            if not pos:
                out.append(hidden.new_zeros((0, T)))
                continue
            idx = torch.tensor(pos, device=hidden.device)
            logits = (q[b][:, idx] @ k[b].transpose(1, 2)) * attn.scaling  # (H, P, T)
            causal = torch.arange(T, device=hidden.device)[None, None, :] > idx[None, :, None]
            logp = torch.log_softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
            out.append(logp.reshape(H * len(pos), T))
        return out


def cell_click(grid: torch.Tensor, unit: int, window: int) -> tuple[float, float]:
    """The click a mass grid (rows, columns) over the screen's cells of `unit` model px points at: the
    mass-weighted mean of the cell centres in the (2 `window` + 1)^2 block around the cell with the most
    mass (`window` 0: that cell's centre), in model pixels.

    >>> cell_click(torch.tensor([[0.0, 0.1], [0.6, 0.3]]), 28, 0)
    (14.0, 42.0)
    """
    rows, cols = grid.shape
    r, c = divmod(int(grid.argmax()), cols)
    r0, r1 = max(0, r - window), min(rows, r + window + 1)
    c0, c1 = max(0, c - window), min(cols, c + window + 1)
    block = grid[r0:r1, c0:c1].double()
    ys = (torch.arange(r0, r1, dtype=block.dtype) + 0.5) * unit
    xs = (torch.arange(c0, c1, dtype=block.dtype) + 0.5) * unit
    total = block.sum()
    return float((block.sum(0) * xs).sum() / total), float((block.sum(1) * ys).sum() / total)


class Pointed(NamedTuple):
    """What a reply's pointing heads read (decision "Clicks read from the pointing head"): their mass over
    the last screenshot's cells (`grid`: rows x columns, cells of `unit` model px) at the reply's first
    click, and `at`, the position that predicts x's first character."""

    grid: torch.Tensor
    unit: int
    at: int

    def click(self, readout: str, written: tuple[float, float] | None = None) -> tuple[float, float]:
        """The click `readout` (`READOUTS`) reads off the grid, in model pixels; `guarded` keeps the
        `written` click (model pixels) where it lies in the most-attended cell or one of its 8 neighbours.

        >>> p = Pointed(torch.tensor([[0.0, 0.1, 0.0], [0.6, 0.3, 0.0]]), 28, 0)
        >>> p.click("cell"), p.click("guarded", (40.0, 50.0)), p.click("guarded", (80.0, 50.0))
        ((14.0, 42.0), (40.0, 50.0), (14.0, 42.0))
        """
        Pointed.check(readout)
        if readout == "guarded":
            r, c = divmod(int(self.grid.argmax()), self.grid.shape[1])
            if (
                written is not None
                and max(abs(written[1] // self.unit - r), abs(written[0] // self.unit - c)) <= 1
            ):
                return written
        return cell_click(self.grid, self.unit, 1 if readout == "block" else 0)

    @staticmethod
    def check(readout: str) -> None:
        """A one-line error for a readout not in `READOUTS`."""
        if readout not in READOUTS:
            raise ValueError(f"unknown click readout {readout!r}; choose one of {', '.join(READOUTS)}")


@torch.no_grad()
def pointed(
    policy: Policy,
    encoded: Sequence[EncodedSequence],
    *,
    heads: int = 1,
    positions: str = "x",
    batch_size: int = 16,
) -> list[Pointed | None]:
    """What each sequence's reply points at, teacher-forced: at the position that predicts x's first
    character (`positions` "x"; "xy": also y's, the two averaged), the first `heads` heads of the last
    layer over the last screenshot's cells. None where the reply has no `start_box='(` or the sequence no
    image. One forward per batch serves every readout (`Pointed.click`)."""
    if positions not in ("x", "xy"):
        raise ValueError(f"pointed clicks: positions must be 'x' or 'xy', got {positions!r}")
    unit = cell_size(policy)
    out: list[Pointed | None] = []
    for i in range(0, len(encoded), batch_size):
        chunk = list(encoded[i : i + batch_size])
        firsts = [click_positions(policy, enc, first=True) or [] for enc in chunk]
        firsts = [q[:1] if positions == "x" else q for q in firsts]
        batch = collate(chunk, policy.pad_id, policy.image_token_id).to(policy.device)
        with HeadWeights(policy, heads) as capture:  # the forward only feeds the hook: one position's logits
            forward_logits(policy.model, batch, 1)
            weights = capture.log_weights(firsts)
        for enc, q, w in zip(chunk, firsts, weights, strict=True):
            cells, rows, cols = image_cells(policy, enc)
            if not q or not cells:
                out.append(None)
                continue
            grid = w.exp().mean(0)[cells].view(rows, cols)  # heads and positions averaged
            out.append(Pointed(grid.cpu(), unit, q[0]))
    return out
