"""Batched generation for live episodes: a `Generator` protocol, the HF (torch) backend, and a vLLM backend.

Decisions:
1. The HF backend runs its own decode loop over `Qwen2_5_VLForConditionalGeneration` with a KV cache
   instead of `model.generate`, so that (a) sampling uses one private `torch.Generator` per prompt,
   seeded with that prompt's own seed (`seeds[b]`), and never touches the global RNG: a prompt gives the
   same reply whatever batch it shares and whatever row it sits in (a one-prompt call with the same
   seed gives the same reply), so the caller decides reproducibility by choosing the seeds (the rollout
   derives them from the episode's job and step, rollout.py decision 5); (b) the log-prob of every
   sampled token is taken from the same raw logits the trainer recomputes.
2. Behaviour log-probs are log_softmax of the RAW logits (temperature 1, no top-p truncation) at the
   sampled token: GRPO's old_logps are recomputed by the trainer at temperature 1 (docs/method.md §1), so
   these are directly comparable with `sequences.sequence_logprobs` (tests hold them within 1e-4 in fp32).
   Temperature and top-p only shape which token is drawn. temperature == 0 means greedy (argmax).
3. Left padding with an attention mask; prompt positions are Qwen2.5-VL's 3-D M-RoPE positions from
   `get_rope_index` over each row's unpadded tokens (mm_token_type_ids given, docs/method.md §7); each new
   token continues at (last position + 1) in all three axes, which is what the full forward assigns to
   text after the last image.
4. A row stops at `<|im_end|>` or `<|endoftext|>` (kept as the last token id and log-prob; finish_reason
   "stop") or after max_new_tokens ("length"). The text excludes special tokens.
6. The vision special tokens (`<|image_pad|>`, `<|vision_start|>`, ...; `Policy.vision_token_ids`) are
   never drawn: a reply containing one would come back as history text and corrupt the next prompt's
   image-token count (a crash of the whole batch in `get_rope_index`). Like temperature, this only
   shapes which token is drawn; the recorded log-prob stays the raw one (decision 2). An untrained policy
   samples them readily; a trained one gives them ~0 probability.
5. Prompts are encoded by sequences.encode_prompt, the function the trainer uses, so a step's prompt is a
   token-exact prefix of the trajectory's training sequence.
7. Sampling settings (temperature, top_p, max_new_tokens) and the prompt settings (system prompt,
   history window) are required keyword arguments: params.yaml is their one source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from arpo_core.policy.model import Policy
from arpo_core.policy.prompt import PromptInput, build_segments
from arpo_core.policy.sequences import collate, encode_prompt

__all__ = ["Generation", "Generator", "HFGenerator", "VLLMGenerator", "sample_next", "top_p_filter"]


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
        """One reply per prompt; prompt b is sampled with `seeds[b]` (decision 1). `seeds` may be None
        only for greedy decoding (temperature 0)."""
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
    generators: Sequence[torch.Generator],
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row: logits (B, V) -> ids (B,). temperature 0 = greedy. `banned` token ids
    are never drawn (decision 6)."""
    if banned is not None and banned.numel():
        logits = logits.index_fill(-1, banned, float("-inf"))
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


class HFGenerator:
    """Batched generation with the transformers model (decision 1)."""

    def __init__(self, policy: Policy, *, system: str, history_images: int | None):
        self.policy = policy
        self.system = system
        self.history_images = history_images

    @torch.no_grad()
    def generate(
        self,
        batch: list[PromptInput],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        seeds = _check_seeds(batch, temperature, seeds)
        if not batch:
            return []
        policy, model = self.policy, self.policy.model
        device = policy.device
        seqs = [
            encode_prompt(policy, p, system=self.system, history_images=self.history_images) for p in batch
        ]
        enc = collate(seqs, policy.pad_id, policy.image_token_id, padding_side="left").to(device)
        B = enc.input_ids.shape[0]
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]  # decision 1
        stop_ids = torch.tensor([policy.im_end_id, policy.pad_id], device=device)
        banned = torch.tensor(policy.vision_token_ids, dtype=torch.long, device=device)

        # Prefill with explicit 3-D positions (decision 3).
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
        out = model(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            position_ids=pos,
            pixel_values=enc.pixel_values,
            image_grid_thw=enc.image_grid_thw,
            mm_token_type_ids=enc.mm_token_type_ids,
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits: (B, 1, V), not (B, T, V)
        )
        cache = out.cache
        logits = out.logits[:, -1]  # (B, V)
        attention = enc.attention_mask

        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_p, gens, banned)  # (B,)
            lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, nxt[:, None]).squeeze(-1)  # (B,)
            for b in range(B):
                if not done[b]:
                    tokens[b].append(int(nxt[b]))
                    logps[b].append(float(lp[b]))
            done |= torch.isin(nxt, stop_ids)
            if bool(done.all()):
                break
            attention = torch.cat(
                [attention, torch.ones((B, 1), dtype=attention.dtype, device=device)], dim=1
            )
            out = model(
                input_ids=nxt[:, None],
                attention_mask=attention,
                position_ids=next_pos.view(1, B, 1).expand(3, B, 1),
                cache=cache,
                use_cache=True,
            )
            cache = out.cache
            logits = out.logits[:, -1]
            next_pos = next_pos + 1

        stops = {policy.im_end_id, policy.pad_id}
        return [
            Generation(
                text=policy.tokenizer.decode(tokens[b], skip_special_tokens=True),
                token_ids=tuple(tokens[b]),
                logprobs=tuple(logps[b]),
                finish_reason="stop" if tokens[b] and tokens[b][-1] in stops else "length",
            )
            for b in range(B)
        ]


class VLLMGenerator:
    """The same interface on vLLM, for GPU machines. UNTESTED in this project's CI (no GPU, and vLLM has
    no CPU wheel: docs/method.md §6).

    Install: vLLM pins its own CUDA torch and transformers, so it lives in a separate GPU environment
    (`scripts/setup_gpu.sh`, the `gpu` extra of pyproject.toml), never in the CPU training venv. The
    import is guarded: constructing this class without vLLM raises ImportError with that hint.

    Prompts are the same segments as the HF backend, passed as token ids (one `<|image_pad|>` per image;
    vLLM expands it from the image) with the screenshots as multi-modal data, so earlier replies keep
    their sampled token ids. `SamplingParams(logprobs=0)` returns the sampled token's log-prob; vLLM's
    default `logprobs_mode` is the raw model log-probs (before temperature/top-p), matching decision 2
    (set `logprobs_mode="raw_logprobs"` explicitly where the vLLM version supports it).
    """

    def __init__(
        self,
        policy: Policy,
        model_path: str,
        *,
        system: str,
        history_images: int | None,
        **llm_kwargs,
    ):
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - exercised only on GPU machines
            raise ImportError(
                "VLLMGenerator needs vLLM, which is installed in a separate GPU environment "
                "(scripts/setup_gpu.sh); use HFGenerator on CPU"
            ) from e
        self.policy = policy
        self.system = system
        self.history_images = history_images
        limit = {"image": 15 if history_images is None else history_images}
        self.llm = LLM(model=model_path, limit_mm_per_prompt=limit, **llm_kwargs)

    def _prompt(self, p: PromptInput) -> dict:
        segs = build_segments(
            p.instruction,
            len(p.screenshots),
            p.replies,
            system=self.system,
            history_images=self.history_images,
        )
        tok, ids, images = self.policy.tokenizer, [], []
        for s in segs:
            if s.kind == "text":
                ids += tok.encode(s.text, add_special_tokens=False)
            elif s.kind == "image":
                ids.append(self.policy.image_token_id)
                images.append(p.screenshots[s.step].convert("RGB"))
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
    ) -> list[Generation]:  # pragma: no cover - GPU only
        from vllm import SamplingParams

        seeds = _check_seeds(batch, temperature, seeds)
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
                logit_bias={i: -100.0 for i in self.policy.vision_token_ids},  # decision 6
            )
            for seed in seeds
        ]
        outs = self.llm.generate([self._prompt(p) for p in batch], params)
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = tuple(c.token_ids)
            lps = tuple(float(step[t].logprob) for t, step in zip(ids, c.logprobs, strict=True))
            result.append(Generation(c.text, ids, lps, "stop" if c.finish_reason == "stop" else "length"))
        return result
