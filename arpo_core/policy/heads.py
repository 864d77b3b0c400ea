"""The language model's last-layer attention heads, read: which screen cells a reply position attends to,
and the click they point at (`pointed`, `Pointed.click`; generation may take its clicks from it with
`policy.click_readout`, decision "Clicks read from the pointing head"). The ground stage trains and
measures its pointing heads with this (arpo_core/offline/grounding.py, decision "Pointing loss").

Decisions:
- **Weights recomputed from the layer's inputs.** A head's attention weights are recomputed from the inputs
  of the layer's attention kept by a hook (`AttentionInputs`): the layer's own q/k projections, q/k norms
  where the family has them (Qwen3-VL), its rotary embedding and scaling, a softmax over the causal prefix
  (`HeadWeights`). So they are the weights the layer uses whatever attention kernel the model runs (SDPA
  and flash kernels return none), in fp32 even inside a bf16 forward, and differentiable for a loss.
- **Clicks read from the pointing head.** At the position that predicts the first character of a click's
  x (the one that has read no digit of it), the first `heads` heads of the last layer, averaged, over the
  current screenshot's cells (its merged tokens, `image_cells`); the click is the cell with the most mass
  (`cell`: its centre) or the mass-weighted mean of the cell centres in the 3x3 block around it (`block`),
  in the model frame's pixels; or (`guarded`) the written click where it lies in that cell or one of its 8
  neighbours, the cell's centre elsewhere: the head vetoes digits that point far from what it attends,
  and where the two agree the digits keep their sub-cell precision. The head is taught on prompts that
  name one target: where an instruction names several in an order (click-checkboxes' "Select a, b and
  click Submit"), it reads one fixed cell and every readout loses to the digits (docs/results.md, "The
  readout in the main job"). This is GUI-Actor's idea (an action head that attends over the screen's
  patches instead of writing digits) with the policy's own pointing head and no new parameters. The
  ground stage's pointing loss teaches head 0 to put its mass on the named target at those positions;
  measured on the 2x reader (docs/results.md, "Clicks read from the pointing head"), the head has the named
  widget more often than the digits that follow it hit it, and at 2x a cell (28 model px, 13 screen px) is
  smaller than the targets. At 1x a cell is 28 screen px, larger than most targets, and the read click loses
  to the written one.
"""

from __future__ import annotations

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
    "click_positions",
    "image_cells",
    "pointed",
]

READOUTS = ("cell", "block", "guarded")
"""The click readouts: the cell with the most mass, its 3x3 block's weighted centre, or the written click
where it lies in that cell's 3x3 block and the cell's centre elsewhere (decision "Clicks read from the
pointing head")."""


def click_positions(policy: Policy, enc: EncodedSequence, first: bool = False) -> list[int] | None:
    """The positions of `enc` whose next token is a character of its reply's click coordinates (inside
    `start_box='(...)`), or with `first` the two that predict x's and y's first characters; [] without a
    reply, None where the reply's decoded tokens have no `start_box='(`. The reply is the first run of
    assistant tokens."""
    ids, mask = enc.input_ids, enc.assistant_mask
    reply = [i for i, m in enumerate(mask) if m]
    if not reply:
        return []
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
        return [
            reply[k] - 1 for k, at in enumerate(starts) if any(at <= c < at + len(pieces[k]) for c in chars)
        ]
    return [reply[k] - 1 for k, at in enumerate(starts) if at < end and at + len(pieces[k]) > begin]


def image_cells(policy: Policy, enc: EncodedSequence) -> tuple[list[int], int, int]:
    """(positions, rows, columns): the positions in `enc` of its last screenshot's merged image tokens (the
    current screen of a prompt with history), in raster order (the tokens the language model gets, in the
    processor's order: rows of merged cells, top to bottom), and the token grid's rows and columns.
    ([], 0, 0) without an image."""
    if enc.image_grid_thw is None:
        return [], 0, 0
    merge = int(policy.processor.image_processor.merge_size)
    _, gh, gw = (int(v) for v in enc.image_grid_thw[-1].tolist())
    rows, cols = gh // merge, gw // merge
    image = [i for i, t in enumerate(enc.input_ids) if t == policy.image_token_id][-rows * cols :]
    return image, rows, cols


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
    proc = policy.processor.image_processor
    unit = int(proc.patch_size) * int(proc.merge_size)
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
