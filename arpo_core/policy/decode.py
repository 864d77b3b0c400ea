"""One decode step of Qwen2.5-VL's or Qwen3-VL's language model without the transformers call machinery,
over a KV cache allocated once per generate call (generate.py, decision "Lean decode steps").

Decisions:
- **Why a lean decoder.** Why: a decode step of the tiny policy is a few dozen small matrix products; through
  the stock forward (output capturing, mask construction, config lookups, a `DynamicCache` that concatenates
  the whole cache at every step) it cost 1.8 ms on this machine's CPU, of which the products are under 0.4 ms.
  Here a step is the same layers' arithmetic called directly: RMSNorm, q/k/v with bias, the module's own
  rotary embedding with `apply_rotary_pos_emb`'s arithmetic written inline (its `rotate_half`; the
  cos/sin for every step built once per call), scaled-dot-product attention over the cache with each
  row's padding masked, o_proj, the gated MLP, final norm and `lm_head` on the one new position.
- **Preallocated cache.** The cache holds the prompt's keys and values (copied once from the prefill's cache)
  and room for `max_new_tokens` more; a step writes its key and value at one index and attends over the prefix
  up to it, so nothing is concatenated. The attention mask is the prompt's padding mask extended with ones,
  as in the stock loop.
- **Same arithmetic.** Numbers: the same operations in the same order as the stock layers, so logits agree to
  float rounding (the stock attention may pick another SDPA path for an unpadded batch);
  `tests/test_generate.py` holds sampled tokens equal and logits within 1e-5 of the stock forward.
- **Applicability check.** `LeanDecoder.supports(model)` says when this path applies: the stock Qwen2.5-VL or
  Qwen3-VL text layers with the default rotary type, no sliding window, a SiLU MLP and an SDPA or eager
  attention implementation on a model that is not being trained or sharded (a ZeRO-3 partitioned weight has
  `ds_id`). Everything else (another attention kernel, flash-attention on a GPU, a patched model, a model
  class of another family) takes the stock forward.
- **Qwen3-VL layers.** Qwen3-VL's layers differ from Qwen2.5-VL's in three ways this path follows: q and k go
  through a per-head RMSNorm (`q_norm`, `k_norm`) before the rotary embedding, the projections have no biases
  (`F.linear` takes None), and the M-RoPE frequencies are interleaved, which the module's own `rotary_emb`
  already applies to the cos/sin it returns. Its DeepStack features are added at image positions only, i.e. in
  the prefill, never in a decode step. `tests/test_generate_qwen3.py` holds the two paths equal.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3

__all__ = ["LeanDecoder"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Qwen2_5_VLRMSNorm.forward`, same operations."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


# model class -> (decoder layer, attention, RMSNorm) classes the lean path reproduces (decisions "Applicability check" and "Qwen3-VL layers")
_STOCK_LAYERS = {
    qwen.Qwen2_5_VLForConditionalGeneration: (
        qwen.Qwen2_5_VLDecoderLayer,
        qwen.Qwen2_5_VLAttention,
        qwen.Qwen2_5_VLRMSNorm,
    ),
    qwen3.Qwen3VLForConditionalGeneration: (
        qwen3.Qwen3VLTextDecoderLayer,
        qwen3.Qwen3VLTextAttention,
        qwen3.Qwen3VLTextRMSNorm,
    ),
}


class LeanDecoder:
    """Decode steps for one batch after the stock prefill (decision "Why a lean decoder")."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Decision "Applicability check"."""
        stock = _STOCK_LAYERS.get(type(model))
        if stock is None or model.training:
            return False
        lm = model.model.language_model
        cfg = lm.config
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            return False
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type != "default" or getattr(cfg, "use_sliding_window", False):
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return False
        if cfg._attn_implementation not in ("sdpa", "eager"):
            return False
        layer_cls, attn_cls, norm_cls = stock
        return all(
            type(layer) is layer_cls
            and type(layer.self_attn) is attn_cls
            and type(layer.input_layernorm) is norm_cls
            and all(
                type(getattr(layer.self_attn, n, None)) in (norm_cls, type(None))
                for n in ("q_norm", "k_norm")
            )
            for layer in lm.layers
        )

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        attention_mask: torch.Tensor,
        first_positions: torch.Tensor,
        max_new_tokens: int,
    ):
        """`cache`: the prefill's cache (one layer per decoder layer, keys/values (B, kv_heads, T, d));
        `attention_mask` (B, T): the prompt's padding mask; `first_positions` (B,): the position of each
        row's first new token, the same in all three M-RoPE axes (generate.py,
        decision "Left padding positions")."""
        lm = model.model.language_model
        self.lm_head = model.lm_head
        self.embed = lm.embed_tokens
        self.final_norm = (lm.norm.weight, lm.norm.variance_epsilon)
        B, T = attention_mask.shape
        self.T = T
        self.layers = []
        for i, layer in enumerate(lm.layers):
            a, m = layer.self_attn, layer.mlp
            k, v = cache.layers[i].keys, cache.layers[i].values
            if k.shape[-2] != T:
                raise ValueError(f"prefill cache of layer {i} has {k.shape[-2]} positions, the prompt {T}")
            keys = k.new_empty((*k.shape[:2], T + max_new_tokens, k.shape[-1]))
            values = v.new_empty((*v.shape[:2], T + max_new_tokens, v.shape[-1]))
            keys[:, :, :T] = k
            values[:, :, :T] = v
            self.layers.append(
                (
                    (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                    (
                        a.q_proj.weight,
                        a.q_proj.bias,
                        a.k_proj.weight,
                        a.k_proj.bias,
                        a.v_proj.weight,
                        a.v_proj.bias,
                    ),
                    (a.o_proj.weight, a.o_proj.bias, a.scaling, a.head_dim, a.num_key_value_groups > 1),
                    tuple(  # Qwen3-VL's per-head q/k norms (decision "Qwen3-VL layers"); None for Qwen2.5-VL
                        None if norm is None else (norm.weight, norm.variance_epsilon)
                        for norm in (getattr(a, "q_norm", None), getattr(a, "k_norm", None))
                    ),
                    (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                    (m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight, m.up_proj.bias),
                    (m.down_proj.weight, m.down_proj.bias),
                    keys,
                    values,
                )
            )
        self.mask = torch.zeros((B, 1, 1, T + max_new_tokens), dtype=torch.bool, device=attention_mask.device)
        self.mask[:, 0, 0, :T] = attention_mask.bool()
        # every step's rotary cos/sin at once: positions first + 0 .. max_new_tokens - 1, (B, N, d)
        steps = torch.arange(max_new_tokens, device=first_positions.device)
        pos = (first_positions[:, None] + steps[None, :]).unsqueeze(0).expand(3, B, max_new_tokens)
        probe = self.embed.weight[:1]
        self.cos, self.sin = lm.rotary_emb(probe, pos)
        self.n = 0  # tokens decoded so far

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed the next token `ids` (B,) of every row; the logits (B, V) of the token after it."""
        B = ids.shape[0]
        t = self.T + self.n
        cos = self.cos[:, self.n : self.n + 1].unsqueeze(1)  # (B, 1, 1, d)
        sin = self.sin[:, self.n : self.n + 1].unsqueeze(1)
        self.n += 1
        self.mask[:, 0, 0, t] = True
        mask = self.mask[:, :, :, : t + 1]
        x = F.embedding(ids[:, None], self.embed.weight)  # (B, 1, h)
        for ln1, qkv, out, (q_norm, k_norm), ln2, gate_up, down, keys, values in self.layers:
            qw, qb, kw, kb, vw, vb = qkv
            ow, ob, scaling, d, gqa = out
            h = _rms(x, *ln1)
            q = F.linear(h, qw, qb).view(B, 1, -1, d)
            k = F.linear(h, kw, kb).view(B, 1, -1, d)
            if q_norm is not None:  # decision "Qwen3-VL layers"
                q = _rms(q, *q_norm)
            if k_norm is not None:
                k = _rms(k, *k_norm)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = F.linear(h, vw, vb).view(B, 1, -1, d).transpose(1, 2)
            q = (q * cos) + (qwen.rotate_half(q) * sin)  # apply_rotary_pos_emb's arithmetic
            k = (k * cos) + (qwen.rotate_half(k) * sin)
            keys[:, :, t] = k[:, :, 0]
            values[:, :, t] = v[:, :, 0]
            o = F.scaled_dot_product_attention(
                q, keys[:, :, : t + 1], values[:, :, : t + 1], attn_mask=mask, scale=scaling, enable_gqa=gqa
            )
            x = x + F.linear(o.transpose(1, 2).reshape(B, 1, -1), ow, ob)
            h = _rms(x, *ln2)
            gw, gb, uw, ub = gate_up
            x = x + F.linear(F.silu(F.linear(h, gw, gb)) * F.linear(h, uw, ub), *down)
        return F.linear(_rms(x, *self.final_norm), self.lm_head.weight, self.lm_head.bias)[:, -1]
