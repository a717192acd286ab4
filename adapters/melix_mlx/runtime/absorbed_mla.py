"""Multi-head latent attention verified in its absorbed form, as mlx-lm decodes one token.

Rules of this module:
- mlx-lm's DeepSeek-V3 attention has two forms. For one query token it absorbs the
  key/value up-projections into the query and the output (attention runs over the
  cached latents); for several tokens it expands every cached latent into full keys and
  values first, an O(context) projection per layer meant for prefill. A verify feeds
  k + 1 tokens against a long context: the expanded form makes it cost like a prefill of
  the whole context, and it is also not the form mlx-lm's own decoding uses.
- `AbsorbedVerifyAttention` (a subclass of mlx-lm's class, installed on the loaded
  model's attention instances by `install`) runs the absorbed form for every query row
  while the engine marks the cache as verifying (`arm`/`disarm`); unmarked, it is
  mlx-lm's `__call__` unchanged. It adds no parameters. GLM-4 MoE Lite's latent
  attention runs the same forward under its own class and gets the same treatment, and
  so does LongCat-Flash's (both attentions of every layer, and its MTP head's), with its
  q / kv low-rank scales.
- Exactness is checked by the greedy identity tests against mlx-lm's token-by-token
  decoding (the absorbed form is the one it uses).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3, deepseek_v32, glm4_moe_lite, longcat_flash
from mlx_lm.models.base import scaled_dot_product_attention

from . import absorbed_bailing, dsa

_VERIFYING = dsa.VERIFYING  # attribute a KV cache leaf carries during a verify forward


def _absorbed_call(self: Any, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
    """The one-token (absorbed) latent attention over a whole verify block."""
    B, L, _ = x.shape
    if self.q_lora_rank is None:
        q = self.q_proj(x)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    compressed_kv = self.kv_a_proj_with_mqa(x)
    compressed_kv, k_pe = mx.split(compressed_kv, [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    kv_latent = self.kv_a_layernorm(compressed_kv)
    q_pe = self.rope(q_pe, cache.offset)
    k_pe = self.rope(k_pe, cache.offset)
    kv_latent, k_pe = cache.update_and_fetch(mx.expand_dims(kv_latent, axis=1), k_pe)
    pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
    if mask is not None:
        pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    output = scaled_dot_product_attention(
        self.embed_q(q_nope), kv_latent, kv_latent, cache=cache, scale=self.scale, mask=pe_scores
    )
    output = self.unembed_out(output)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class AbsorbedVerifyAttention(deepseek_v3.DeepseekV3Attention):
    """mlx-lm's DeepSeek-V3 attention, absorbed for every row of a marked verify."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] == 1 or not getattr(cache, _VERIFYING, False):
            return super().__call__(x, mask, cache)
        return _absorbed_call(self, x, mask, cache)


class AbsorbedGlm4MoeLiteAttention(glm4_moe_lite.Glm4MoeLiteAttention):
    """mlx-lm's GLM-4 MoE Lite latent attention (the same MLA forward), absorbed likewise."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] == 1 or not getattr(cache, _VERIFYING, False):
            return super().__call__(x, mask, cache)
        return _absorbed_call(self, x, mask, cache)


class AbsorbedLongcatAttention(longcat_flash.LongcatFlashMLA):
    """mlx-lm's LongCat-Flash latent attention (its q / kv low-rank scales applied), absorbed."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] == 1 or not getattr(cache, _VERIFYING, False):
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.num_attention_heads, self.qk_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q * self.mla_scale_q_lora, [self.qk_nope_head_dim], axis=-1)
        compressed_kv, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        kv_latent = self.kv_a_layernorm(compressed_kv) * self.mla_scale_kv_lora
        q_pe = self.rope(q_pe, cache.offset)
        k_pe = self.rope(k_pe, cache.offset)
        kv_latent, k_pe = cache.update_and_fetch(mx.expand_dims(kv_latent, axis=1), k_pe)
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        output = scaled_dot_product_attention(
            self.embed_q(q_nope), kv_latent, kv_latent, cache=cache, scale=self.scale, mask=pe_scores
        )
        output = self.unembed_out(output)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


ABSORBED: dict[type, type] = {
    longcat_flash.LongcatFlashMLA: AbsorbedLongcatAttention,  # both sub-layers and the MTP head's
    deepseek_v3.DeepseekV3Attention: AbsorbedVerifyAttention,
    glm4_moe_lite.Glm4MoeLiteAttention: AbsorbedGlm4MoeLiteAttention,
    # sparse attention (deepseek_v32, glm_moe_dsa): one-token form per query (melix_mlx.runtime.dsa)
    deepseek_v32.DeepseekV32Attention: dsa.DsaVerifyAttention,
}
ABSORBED.update(absorbed_bailing.ABSORBED)  # Ling V3 and Ling 2.5 latent attention


def install(model: nn.Module) -> int:
    """Give every MLA attention of `model` its absorbed-verify subclass; returns how many."""
    found: list[nn.Module] = []

    def visit(_: str, module: nn.Module) -> None:
        if type(module) in ABSORBED:
            module.__class__ = ABSORBED[type(module)]
            found.append(module)
        elif type(module) in ABSORBED.values():
            found.append(module)

    model.apply_to_modules(visit)
    return len(found)


def arm(leaves: list[Any]) -> list[Any]:
    """Mark KV leaves for the next forward (a verify)."""
    marked = [c for c in leaves if hasattr(c, "update_and_fetch")]
    for c in marked:
        setattr(c, _VERIFYING, True)
    return marked


def disarm(marked: list[Any]) -> None:
    for c in marked:
        if hasattr(c, _VERIFYING):
            delattr(c, _VERIFYING)
