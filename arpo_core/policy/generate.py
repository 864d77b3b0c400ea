"""Batched generation for live episodes: a `Generator` protocol, the HF (torch) backend, and a vLLM backend.

Decisions:
- **Own decode loop.** The HF backend runs its own decode loop over the policy's model (Qwen2.5-VL or
  Qwen3-VL) with a KV cache instead of `model.generate`, so that (a) sampling uses one private
  `torch.Generator` per prompt, seeded with that prompt's own seed (`seeds[b]`), and never touches the global
  RNG: a prompt gives the same reply whatever batch it shares and whatever row it sits in (a one-prompt call
  with the same seed gives the same reply), so the caller decides reproducibility by choosing the seeds (the
  rollout derives them from the episode's job and step, rollout.py, decision "Per-step sampling seeds"); (b) the log-prob of every
  sampled token is taken from the same raw logits the trainer recomputes.
- **Raw-logit log-probs.** Behaviour log-probs are log_softmax of the RAW logits (temperature 1, no top-p
  truncation) at the sampled token: GRPO's old_logps are recomputed by the trainer at temperature 1
  (docs/method.md §1), so these are directly comparable with `sequences.sequence_logprobs` (tests hold them
  within 1e-4 in fp32). Temperature and top-p only shape which token is drawn. temperature == 0 means greedy
  (argmax).
- **Left padding positions.** Left padding with an attention mask; prompt positions are the model's own 3-D
  M-RoPE positions from its `get_rope_index` over each row's unpadded tokens (mm_token_type_ids given,
  docs/method.md §7; Qwen3-VL has the same interface and refuses a multimodal forward without
  mm_token_type_ids); each new token continues at (last position + 1) in all three axes, which is what the
  full forward assigns to text after the last image, in both families.
- **Stop tokens.** A row stops at `<|im_end|>` or `<|endoftext|>` (kept as the last token id and log-prob;
  finish_reason "stop") or after max_new_tokens ("length"). The text excludes special tokens.
- **Vision tokens banned.** The vision special tokens (`<|image_pad|>`, `<|vision_start|>`, ...;
  `Policy.vision_token_ids`) are never drawn: a reply containing one would come back as history text and
  corrupt the next prompt's image-token count (a crash of the whole batch in `get_rope_index`). Like
  temperature, this only shapes which token is drawn; the recorded log-prob stays the raw one
  (decision "Raw-logit log-probs"). An untrained policy samples them readily; a trained one gives them ~0
  probability.
- **Shared prompt encoding.** Prompts are encoded by sequences.encode_prompt, the function the trainer uses,
  so a step's prompt is a token-exact prefix of the trajectory's training sequence.
- **Required sampling settings.** Sampling settings (temperature, top_p, max_new_tokens) and the prompt
  settings (system prompt, history window) are required keyword arguments: params.yaml is their one source.
- **Generator backends.** `policy.backend` picks the generator (`make_generator`): `hf` generates with the
  policy's own model (the trainer's weights, nothing to sync), `vllm` with a vLLM engine colocated in the same
  process on the same GPU, as TRL's `vllm_mode="colocate"` does: `LLM(..., distributed_executor_backend=
  "external_launcher")` keeps the engine's model in this process. After every update the trainer calls
  `sync_weights(model)`, which hands each parameter to the engine model's own `load_weights` (the
  function vLLM loads checkpoint files with) under its checkpoint name, then clears the prefix cache
  (its KV entries were computed with the old weights). Two ways to reach the engine's model, tried in
  order (`load_into_engine`): the engine's model in this process (`IN_PROCESS_PATHS`:
  `llm.llm_engine.model_executor.driver_worker.model_runner.model`, the path TRL's colocate mode uses
  with vLLM 0.17-0.25, or the `driver_worker.worker.model_runner.model` one verl's sharding managers
  use), else
  `llm.collective_rpc(fn, args=(weights,))`, which runs `fn(worker, weights)` on every worker (engines
  whose workers live in other processes; tensors are pickled, slower). Under DeepSpeed ZeRO-3 each
  parameter is gathered on its own while it is handed over (TRL does the same), so the full model is
  never materialised twice. verl's sharding managers do the same with the FSDP / Megatron weights:
  `model.load_weights(...)` of the in-process vLLM model before each rollout. Written against vLLM
  0.33 (the version scripts/setup_gpu.sh installs) from TRL's and verl's code; NOT RUN here (no GPU).
- **vLLM log-probs.** The log-probs vLLM returns are the behaviour policy's as vLLM computes them (bf16
  kernels, another attention implementation): they are recorded on the trajectory (`gen_logprob_sum`) and
  compared with the trainer's recomputation as a diagnostic (`logprob/*` metrics of trainer.py), never used in
  the loss: GRPO's old log-probs are always the trainer's own (update.py,
  decision "Recomputed old log-probs").
- **One vLLM engine.** One vLLM engine per process (`make_generator` keeps it): vLLM does not give its GPU
  memory back reliably, so a second policy of the same architecture (evaluate's base and trained policies, the
  train stage's evaluations) reuses the engine and only loads its weights.
- **Lean decode steps.** The HF backend's decode steps after the prefill go through `LeanDecoder` (decode.py):
  the same layers' arithmetic without the stock forward's per-call machinery, over a KV cache allocated once
  per call. On this machine's CPU it makes a decode step of the xs policy ~2x cheaper (1.8 -> 0.8 ms at
  batch 1) with the same tokens (tests/test_generate.py). The prefill (images, M-RoPE positions)
  stays the stock forward. `lean_decode = False`, or a model the lean path does not cover
  (`LeanDecoder.supports`: training mode, ZeRO-3 shards, another attention kernel or rotary type),
  takes the stock forward for every step.
- **Shared prompt head.** The prompt head every row of a batch shares (the system prompt and chat markup: 79
  of the 145 tokens of a compact MiniWoB prompt) goes through the language model once per call, not once per
  row (`shared_prefix_len`, `share_prefix`): the batch is laid out as [shared head | left padding | each
  row's rest], the head's keys and values are computed for one row and copied to all, and the rest
  (images included) is the stock forward over that cache. Padding in the middle is masked like
  padding on the left, and the M-RoPE positions come from `get_rope_index` over each row's unmasked
  tokens as before, so every row sees exactly its own prompt at its own positions; logits agree with
  the unshared prefill to float rounding (tests/test_generate.py). It applies where the lean decoder
  does (decision "Lean decode steps": stock layers, SDPA or eager attention) to calls of 2 or more prompts
  sharing at least `MIN_SHARED_PREFIX` tokens. On this machine it made the batch-8 prefill 1.10-1.12x and the
  whole batched call 1.015-1.054x faster (A/B in three runs, benchmarks/results/generation.json,
  `unshared_head`). With one prompt there is nothing to share.
- **Checkpoint names for vLLM.** Weights handed to vLLM carry their checkpoint names, which differ by family
  (`checkpoint_name`): Qwen2.5-VL checkpoints (UI-TARS-1.5) use the older `model.*` / `visual.*` layout,
  Qwen3-VL ones (GUI-Owl-1.5) the transformers parameter names themselves (`model.language_model.*`,
  `model.visual.*`). Not run against vLLM here (no GPU).
- **Read clicks.** With `click_readout` `cell`, `block` or `guarded` (params' `policy.click_readout`), a
  reply's first click is written with the point the policy's last-layer pointing head reads off the screen
  (policy/heads.py, decision "Clicks read from the pointing head") instead of the digits the policy wrote:
  after the decode loop, the prompt and reply go through the model once teacher-forced, the head's
  attention at the position before x's first character is read (it has seen none of the written
  digits), and the reply's tokens from x's first character on are the rewritten text's (`x,y` in model
  pixels, then the rest of the reply as written, then its stop token). Its log-probs are the raw ones of
  the rewritten tokens from a second teacher-forced forward, the same quantity as sampled tokens' (decision
  "Raw-logit log-probs"), so the trajectory, the trainer's recomputation and GRPO's ratio see one
  consistent reply: like temperature and top-p, the readout only decides which tokens are emitted. A reply
  without a complete `start_box='(x,y)'` is left as written, and so is one whose written click `guarded`
  keeps. Two extra forwards per call of replies with clicks; the HF backend only (vLLM's engine gives no
  attention weights).
- **Cache keyword.** The KV cache goes in and out under the installed transformers' name for it (`CACHE_KW`,
  `_cache_of`): `cache` since 5.2x, `past_key_values` before (5.17, the GPU environment's); nothing else
  differs.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from arpo_core.policy.decode import LeanDecoder
from arpo_core.policy.heads import READOUTS, pointed
from arpo_core.policy.model import Policy
from arpo_core.policy.prompt import PromptInput, PromptSpec, build_segments
from arpo_core.policy.sequences import EncodedSequence, collate, encode_prompt, sequence_logprobs

if TYPE_CHECKING:
    from arpo_core.config import PolicyConfig

__all__ = [
    "MIN_SHARED_PREFIX",
    "Generation",
    "Generator",
    "HFGenerator",
    "VLLMGenerator",
    "checkpoint_name",
    "load_into_engine",
    "make_generator",
    "named_weights",
    "sample_next",
    "shared_prefix_len",
    "top_p_filter",
]

MIN_SHARED_PREFIX = 16
"""Decision "Shared prompt head": shorter shared heads are not worth a second forward call."""

CACHE_KW = (
    "cache"
    if "cache" in inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters
    else "past_key_values"
)
"""Decision "Cache keyword": the forward's keyword (and the output's field) of the KV cache in this transformers."""


def _cache_of(out: Any) -> Any:
    """The KV cache of a forward's output (decision "Cache keyword")."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@dataclass(frozen=True)
class Generation:
    """One generated reply."""

    text: str
    """Decoded reply without special tokens."""
    token_ids: tuple[int, ...]
    """Sampled ids, including the stop token when finish_reason == 'stop'."""
    logprobs: tuple[float, ...]
    """Raw-logit (temperature 1) log-prob of each sampled id under the behaviour policy; same length."""
    finish_reason: Literal["stop", "length"]


class Generator(Protocol):
    """Anything that turns a batch of prompts into replies (HF on CPU/GPU, vLLM on GPU)."""

    def generate(
        self,
        batch: list[PromptInput],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One reply per prompt; prompt b is sampled with `seeds[b]` (decision "Own decode loop"). `seeds` may
        be None only for greedy decoding (temperature 0)."""
        ...


def _check_seeds(batch: Sequence[PromptInput], temperature: float, seeds: Sequence[int] | None) -> list[int]:
    """The per-prompt seeds of a call: one per prompt; None is accepted for greedy decoding only."""
    if seeds is None:
        if temperature != 0.0:
            raise ValueError("sampling (temperature > 0) needs one seed per prompt (seeds=...)")
        return [0] * len(batch)
    if len(seeds) != len(batch):
        raise ValueError(f"{len(batch)} prompts need {len(batch)} seeds, got {len(seeds)}")
    return [int(s) for s in seeds]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches top_p; renormalise.

    probs (B, V) -> (B, V). A token is kept when the mass of the tokens strictly more likely than it is
    below top_p (so the most likely token is always kept).
    """
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly ahead of each token
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    uniforms: torch.Tensor | None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row: logits (B, V) -> ids (B,). temperature 0 = greedy. `banned` token ids
    are never drawn (decision "Vision tokens banned"). A sampled row b takes the token where its cumulative
    distribution first reaches `uniforms[b]` (in (0, 1], drawn from the row's own generator;
    decision "Own decode loop"): inverse-CDF sampling, one vectorised search for the whole batch instead of
    one multinomial call per row."""
    if banned is not None and banned.numel():
        logits = logits.index_fill(-1, banned, float("-inf"))
    if temperature == 0.0:
        return logits.argmax(-1)
    if uniforms is None:
        raise ValueError("sampling (temperature > 0) needs one uniform draw per row")
    cdf = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p).cumsum(-1)  # (B, V)
    total = cdf[:, -1:]
    # first index whose cumulative mass reaches u * total: never a zero-probability token, since u > 0
    target = torch.minimum(uniforms.to(cdf).unsqueeze(-1) * total, total)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def shared_prefix_len(seqs: Sequence[EncodedSequence], image_token_id: int) -> int:
    """How many leading tokens all `seqs` have in common, up to the first image token
    (decision "Shared prompt head")."""
    ids = [s.input_ids for s in seqs]
    n = min(len(x) for x in ids)
    first = ids[0]
    k = 0
    while k < n and first[k] != image_token_id and all(x[k] == first[k] for x in ids):
        k += 1
    return k


class HFGenerator:
    """Batched generation with the transformers model (decision "Own decode loop")."""

    lean_decode: bool = True
    """Decision "Lean decode steps": decode steps through `LeanDecoder` where it supports the model."""
    share_prefix: bool = True
    """Decision "Shared prompt head": the prompt head all rows share goes through the language model once per
    call."""

    def __init__(self, policy: Policy, *, spec: PromptSpec, click_readout: str = "tokens"):
        if click_readout != "tokens" and click_readout not in READOUTS:
            raise ValueError(
                f"unknown click_readout {click_readout!r}; choose tokens or {' or '.join(READOUTS)}"
            )
        self.policy = policy
        self.spec = spec
        self.click_readout = click_readout
        """Decision "Read clicks": `tokens`, or a readout of policy/heads.py."""

    @classmethod
    def of(cls, policy: Policy, cfg: PolicyConfig) -> HFGenerator:
        """The generator params' `policy` section asks for (prompt and click readout)."""
        return cls(policy, spec=PromptSpec.of(cfg), click_readout=cfg.click_readout)

    def banned_ids(self) -> list[int]:
        """Token ids never drawn (decision "Vision tokens banned"); a subclass may ban more (the benchmarks
        ban the stop ids)."""
        return self.policy.vision_token_ids

    def use_lean_decoder(self, model: torch.nn.Module) -> bool:
        return self.lean_decode and LeanDecoder.supports(model)

    def generate(
        self,
        batch: list[PromptInput],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One reply per prompt. The model generates in eval mode (no dropout, the lean decoder
        applies) and is put back in the mode it was in: the trainer leaves it in train mode after an
        update."""
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            gens = self._generate(
                batch, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seeds=seeds
            )
            return gens if self.click_readout == "tokens" else self._read_clicks(batch, gens)
        finally:
            model.train(was_training)

    @torch.no_grad()
    def _read_clicks(self, batch: list[PromptInput], gens: list[Generation]) -> list[Generation]:
        """Decision "Read clicks": each reply's first click, written with the point its pointing head reads
        (`heads.pointed`), its tokens and raw log-probs those of the rewritten reply."""
        policy = self.policy
        rows = [b for b, g in enumerate(gens) if _CLICK.search(g.text)]
        if not rows:
            return gens
        prompts = {b: encode_prompt(policy, batch[b], spec=self.spec) for b in rows}

        def whole(b: int, ids: Sequence[int]) -> EncodedSequence:
            p = prompts[b]
            mask = [False] * len(p.input_ids) + [True] * len(ids)
            return EncodedSequence(p.input_ids + list(ids), mask, p.pixel_values, p.image_grid_thw)

        reads = pointed(policy, [whole(b, gens[b].token_ids) for b in rows])
        stops = {policy.im_end_id, policy.pad_id}
        new: dict[int, list[int]] = {}
        for b, read in zip(rows, reads, strict=True):
            g = gens[b]
            found = _CLICK.search(g.text)
            if read is None or found.start() != g.text.find("start_box='("):
                continue
            written = tuple(float(v) for v in found.group(1).split(","))
            click = read.click(self.click_readout, written)
            if click == written:  # `guarded` kept the written click: the reply stands as sampled
                continue
            k = read.at + 1 - len(prompts[b].input_ids)  # the reply token holding x's first character
            head = policy.tokenizer.decode(g.token_ids[:k], skip_special_tokens=True)
            text = f"{g.text[: found.start(1)]}{round(click[0])},{round(click[1])}{g.text[found.end(1) :]}"
            if not text.startswith(head):  # a token that spans the click's start and what precedes it
                continue
            stop = [g.token_ids[-1]] if g.finish_reason == "stop" and g.token_ids[-1] in stops else []
            new[b] = [
                *g.token_ids[:k],
                *policy.tokenizer.encode(text[len(head) :], add_special_tokens=False),
                *stop,
            ]
        if not new:
            return gens
        order = sorted(new)
        encoded = [whole(b, new[b]) for b in order]
        logps, _ = sequence_logprobs(
            policy.model, collate(encoded, policy.pad_id, policy.image_token_id).to(policy.device)
        )
        out = list(gens)
        for row, b in enumerate(order):
            start = len(prompts[b].input_ids)
            ids = new[b]
            out[b] = Generation(
                text=policy.tokenizer.decode(ids, skip_special_tokens=True),
                token_ids=tuple(ids),
                logprobs=tuple(logps[row, start : start + len(ids)].tolist()),
                finish_reason=gens[b].finish_reason,
            )
        return out

    @torch.no_grad()
    def _generate(
        self,
        batch: list[PromptInput],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: Sequence[int] | None,
    ) -> list[Generation]:
        seeds = _check_seeds(batch, temperature, seeds)
        if not batch:
            return []
        policy, model = self.policy, self.policy.model
        device = policy.device
        seqs = [encode_prompt(policy, p, spec=self.spec) for p in batch]
        head = 0
        if self.share_prefix and len(seqs) > 1 and self.use_lean_decoder(model):
            # decision "Shared prompt head"
            head = shared_prefix_len(seqs, policy.image_token_id)
            if head < MIN_SHARED_PREFIX:
                head = 0
        enc = collate(seqs, policy.pad_id, policy.image_token_id, padding_side="left", shared_head=head).to(
            device
        )
        B = enc.input_ids.shape[0]
        # (B, max_new_tokens) in (0, 1]: row b's draws from its own seed (decision "Own decode loop")
        uniforms = None
        if temperature > 0:
            gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
            uniforms = 1.0 - torch.stack(
                [torch.rand(max_new_tokens, generator=g, device=device) for g in gens]
            )
        stop_ids = torch.tensor([policy.im_end_id, policy.pad_id], device=device)
        banned = torch.tensor(self.banned_ids(), dtype=torch.long, device=device)

        # Prefill with explicit 3-D positions (decision "Left padding positions").
        if enc.image_grid_thw is not None:
            pos, _ = model.model.get_rope_index(
                enc.input_ids,
                mm_token_type_ids=enc.mm_token_type_ids,
                image_grid_thw=enc.image_grid_thw,
                attention_mask=enc.attention_mask,
            )  # (3, B, T)
        else:
            pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        next_pos = pos.amax(dim=(0, 2)) + 1  # (B,)
        cache = None
        if head:  # decision "Shared prompt head": the head's keys and values once, copied to every row
            cache = _cache_of(
                model.model.language_model(
                    input_ids=enc.input_ids[:1, :head], position_ids=pos[:, :1, :head], use_cache=True
                )
            )
            for layer in cache.layers:
                layer.keys = layer.keys.expand(B, -1, -1, -1).contiguous()
                layer.values = layer.values.expand(B, -1, -1, -1).contiguous()
        out = model(
            input_ids=enc.input_ids[:, head:],
            attention_mask=enc.attention_mask,
            position_ids=pos[:, :, head:],
            pixel_values=enc.pixel_values,
            image_grid_thw=enc.image_grid_thw,
            mm_token_type_ids=enc.mm_token_type_ids[:, head:],
            **{CACHE_KW: cache},
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits: (B, 1, V), not (B, T, V)
        )
        cache = _cache_of(out)
        logits = out.logits[:, -1]  # (B, V)
        attention = enc.attention_mask
        lean = None
        if self.use_lean_decoder(model):
            lean = LeanDecoder(model, cache, attention, next_pos, max_new_tokens)

        drawn: list[torch.Tensor] = []  # per step (B,) token ids; rows are cut at their stop below
        drawn_lp: list[torch.Tensor] = []
        done = torch.zeros(B, dtype=torch.bool, device=device)
        for t in range(max_new_tokens):
            nxt = sample_next(
                logits, temperature, top_p, None if uniforms is None else uniforms[:, t], banned
            )
            drawn.append(nxt)
            drawn_lp.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, nxt[:, None]).squeeze(-1))
            done |= torch.isin(nxt, stop_ids)
            if bool(done.all()):
                break
            if lean is not None:  # decision "Lean decode steps"
                logits = lean.step(nxt)
            else:
                attention = torch.cat(
                    [attention, torch.ones((B, 1), dtype=attention.dtype, device=device)], dim=1
                )
                out = model(
                    input_ids=nxt[:, None],
                    attention_mask=attention,
                    position_ids=next_pos.view(1, B, 1).expand(3, B, 1),
                    **{CACHE_KW: cache},
                    use_cache=True,
                )
                cache = _cache_of(out)
                logits = out.logits[:, -1]
            next_pos = next_pos + 1

        stops = {policy.im_end_id, policy.pad_id}
        tokens = torch.stack(drawn, dim=1).tolist()  # (B, steps): one transfer, not one per token
        logps = torch.stack(drawn_lp, dim=1).tolist()
        for b in range(B):  # a row ends at its first stop token (kept, decision "Stop tokens")
            end = next((i + 1 for i, tok in enumerate(tokens[b]) if tok in stops), len(tokens[b]))
            tokens[b], logps[b] = tokens[b][:end], logps[b][:end]
        return [
            Generation(
                text=policy.tokenizer.decode(tokens[b], skip_special_tokens=True),
                token_ids=tuple(tokens[b]),
                logprobs=tuple(logps[b]),
                finish_reason="stop" if tokens[b] and tokens[b][-1] in stops else "length",
            )
            for b in range(B)
        ]


_CLICK = re.compile(r"start_box='\((\s*-?\d+(?:\.\d+)?\s*,\s*-?\d+(?:\.\d+)?\s*)\)")
"""A reply's first written click point: group 1 is its `x,y` (decision "Read clicks")."""


def checkpoint_name(name: str, family: str = "qwen2_5_vl") -> str:
    """A parameter of transformers' Qwen2.5-VL (`model.language_model.*`, `model.visual.*`, `lm_head.*`)
    -> its name in a checkpoint file (`model.*`, `visual.*`, `lm_head.*`), the layout of UI-TARS-1.5-7B's
    safetensors and of what `save_pretrained` writes, i.e. what the vLLM engine loaded at its start.
    Qwen3-VL checkpoints keep the parameter names (decision "Checkpoint names for vLLM")."""
    if family == "qwen3_vl":
        return name
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(checkpoint name, parameter) of every parameter once (tied embeddings: the embedding only, as in
    the checkpoint file)."""
    family = str(getattr(getattr(model, "config", None), "model_type", "qwen2_5_vl"))
    return [(checkpoint_name(n, family), p) for n, p in model.named_parameters()]


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside a vLLM worker (collective_rpc): the worker's model loads `weights`."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model.load_weights(weights=weights)


IN_PROCESS_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
    (
        "llm_engine",
        "engine_core",
        "engine_core",
        "model_executor",
        "driver_worker",
        "worker",
        "model_runner",
        "model",
    ),
)
"""Where an in-process vLLM engine keeps its model (decision "Generator backends"): TRL's colocate path,
verl's sharding managers' path, and the V1 engine core behind an in-process client."""


def _in_process_model(llm: Any) -> Any | None:
    """The engine's model when it lives in this process (decision "Generator backends"), else None."""
    for path in IN_PROCESS_PATHS:
        obj = llm
        try:
            for attr in path:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        if callable(getattr(obj, "load_weights", None)):
            return obj
    return None


def load_into_engine(llm: Any, weights: list[tuple[str, torch.Tensor]]) -> str:
    """Hand (checkpoint name, tensor) pairs to the vLLM engine's model (decision "Generator backends");
    returns the path used: 'in_process' or 'collective_rpc'."""
    model = _in_process_model(llm)
    if model is not None:
        model.load_weights(weights)
        return "in_process"
    if hasattr(llm, "collective_rpc"):
        llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        return "collective_rpc"
    raise RuntimeError(
        "cannot reach the vLLM engine's model: neither llm.llm_engine.model_executor.driver_worker."
        "model_runner.model nor llm.collective_rpc exists in this vLLM version"
    )


class VLLMGenerator:
    """The same interface on vLLM, for GPU machines, colocated with the trainer
    (decisions "Generator backends", "vLLM log-probs" and "One vLLM engine"). UNTESTED against a real vLLM in
    this project's CI (no GPU, and vLLM has no CPU wheel: docs/method.md §6); tests drive it with a fake
    engine.

    Install: vLLM pins its own CUDA torch and transformers, so it lives in a separate GPU environment
    (`scripts/setup_gpu.sh`, the `gpu` extra of pyproject.toml), never in the CPU training venv. The
    import is lazy: constructing this class without vLLM raises ImportError with that hint.

    Prompts are the same segments as the HF backend, passed as token ids (one `<|image_pad|>` per image;
    vLLM expands it from the image) with the screenshots as multi-modal data, so earlier replies keep
    their sampled token ids; the engine's image processor gets the policy's own pixel budget, so an image
    becomes as many tokens as in the trainer's sequence. `SamplingParams(logprobs=0)` returns the sampled
    token's log-prob, and the engine is built with `logprobs_mode="raw_logprobs"` (log_softmax of the raw
    logits, before temperature / top-p / logit bias), decision "Raw-logit log-probs"'s definition; vLLM
    versions without that argument get their default, which was the raw log-probs. Reply text is decoded by
    the policy's own tokenizer, as in the HF backend.
    """

    def __init__(
        self,
        policy: Policy,
        model_path: str,
        *,
        spec: PromptSpec,
        max_images: int,
        sleep_mode: bool = False,
        llm: Any = None,
        **llm_kwargs: Any,
    ):
        """`max_images`: images per prompt when `history_images` is None (the episode step limit);
        `llm`: an engine to use instead of building one (a reused engine, or a test's stand-in);
        `llm_kwargs` go to `vllm.LLM` (gpu_memory_utilization, max_model_len, dtype, enforce_eager)."""
        self.policy = policy
        self.spec = spec
        self.sleep_mode = sleep_mode
        self.weights_version = 0
        """How many times `sync_weights` ran."""
        self.last_sync_path = ""
        self._asleep = False
        self.llm = llm if llm is not None else self._build(model_path, max_images, llm_kwargs)

    def _build(self, model_path: str, max_images: int, llm_kwargs: dict[str, Any]) -> Any:
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                "policy.backend=vllm needs vLLM, which is installed in a separate GPU environment "
                "(scripts/setup_gpu.sh); use policy.backend=hf on CPU"
            ) from e
        # external_launcher (decision "Generator backends") joins this process's torch.distributed world
        # (DeepSpeed's, when the trainer built its engine first) or starts a one-process world from these
        # variables.
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        limit = self.spec.history_images if self.spec.history_images is not None else max_images
        kwargs = {
            "model": str(model_path),
            "limit_mm_per_prompt": {"image": limit},
            "mm_processor_kwargs": {
                "min_pixels": self.policy.min_pixels,
                "max_pixels": self.policy.max_pixels,
            },
            "distributed_executor_backend": "external_launcher",
            "enable_sleep_mode": self.sleep_mode,
            "seed": 0,
            "logprobs_mode": "raw_logprobs",
            **llm_kwargs,
        }
        try:
            return LLM(**kwargs)
        except TypeError as e:  # a vLLM without logprobs_mode: its default was the raw log-probs
            if "logprobs_mode" not in str(e):
                raise
            kwargs.pop("logprobs_mode")
            return LLM(**kwargs)

    def before_update(self) -> None:
        """Called by the trainer before an update: with sleep mode, vLLM frees its GPU memory (level 1:
        weights to CPU, KV cache dropped) for the update's activations."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load `model`'s current weights into the engine (decision "Generator backends"). ZeRO-3 shards are
        gathered one parameter at a time."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        pairs = named_weights(model)
        if any(hasattr(p, "ds_id") for _, p in pairs):  # DeepSpeed ZeRO-3 partitioned parameters
            import deepspeed

            for name, p in pairs:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    self.last_sync_path = load_into_engine(self.llm, [(name, p.data)])
        else:
            self.last_sync_path = load_into_engine(self.llm, [(name, p.data) for name, p in pairs])
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        self.weights_version += 1

    def _prompt(self, p: PromptInput) -> dict:
        segs = build_segments(
            p.instruction,
            len(p.screenshots),
            p.replies,
            spec=self.spec,
        )
        tok, ids, images = self.policy.tokenizer, [], []
        for s in segs:
            if s.kind == "text":
                ids += tok.encode(s.text, add_special_tokens=False)
            elif s.kind == "image":
                ids.append(self.policy.image_token_id)
                images += self.policy.model_images([p.screenshots[s.step].convert("RGB")])
            else:
                ids += list(s.reply.token_ids) or tok.encode(s.reply.text, add_special_tokens=False)
                if ids[-1] != self.policy.im_end_id:
                    ids.append(self.policy.im_end_id)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def generate(
        self,
        batch: list[PromptInput],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        from vllm import SamplingParams

        seeds = _check_seeds(batch, temperature, seeds)
        if not batch:
            return []
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        stops = [self.policy.im_end_id, self.policy.pad_id]
        params = [
            SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=seed,
                logprobs=0,
                stop_token_ids=stops,
                skip_special_tokens=True,
                # decision "Vision tokens banned"
                logit_bias={i: -100.0 for i in self.policy.vision_token_ids},
            )
            for seed in seeds
        ]
        outs = self.llm.generate([self._prompt(p) for p in batch], params, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = tuple(int(t) for t in c.token_ids)
            lps = tuple(float(step[t].logprob) for t, step in zip(ids, c.logprobs, strict=True))
            text = self.policy.tokenizer.decode(ids, skip_special_tokens=True)
            stopped = bool(ids) and ids[-1] in stops
            result.append(Generation(text, ids, lps, "stop" if stopped else "length"))
        return result


_ENGINE: dict[str, Any] = {}
"""The process's vLLM engine and the config.json text of the model it was built for
(decision "One vLLM engine")."""


def make_generator(
    policy: Policy, policy_dir: str | os.PathLike, cfg: PolicyConfig, *, max_images: int
) -> Generator:
    """The generator of `cfg.backend` (params' `policy` section) for `policy`, loaded from `policy_dir`
    (decision "Generator backends"). A vLLM engine already built in this process for a model of the same
    config is reused (decision "One vLLM engine"); either way the engine gets `policy`'s weights before the
    first reply."""
    if cfg.backend == "hf":
        return HFGenerator.of(policy, cfg)
    if cfg.backend != "vllm":
        raise ValueError(f"unknown policy.backend {cfg.backend!r}; choose 'hf' or 'vllm'")
    config_text = (Path(policy_dir) / "config.json").read_text()
    v = cfg.vllm
    llm = _ENGINE.get("llm") if _ENGINE.get("config") == config_text else None
    if llm is None and _ENGINE:
        _drop_engine()
    gen = VLLMGenerator(
        policy,
        str(policy_dir),
        spec=PromptSpec.of(cfg),
        max_images=max_images,
        sleep_mode=v.sleep_mode,
        llm=llm,
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_model_len=v.max_model_len,
        dtype=v.dtype,
        enforce_eager=v.enforce_eager,
    )
    _ENGINE.update(llm=gen.llm, config=config_text)
    gen.sync_weights(policy.model)
    return gen


def _drop_engine() -> None:
    """Release the process's engine (a model of another architecture is next)."""
    import gc

    _ENGINE.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
