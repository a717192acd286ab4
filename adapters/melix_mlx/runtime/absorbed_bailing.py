"""The Bailing families' latent attention verified in its absorbed (one-token) form.

Rules of this module:
- Same contract as melix_mlx.runtime.absorbed_mla (whose registry, `ABSORBED`, lists the
  classes here): a subclass of mlx-lm's class, installed on the loaded model's (and the
  head's) attention instances, adding no parameters; while the engine marks the cache as
  verifying, every query row of the block runs the absorbed form mlx-lm uses for one
  token (attention over the cached latents, the value up-projection after it); unmarked,
  or for one token, it is mlx-lm's `__call__` unchanged.
- mlx-lm's multi-token form expands every cached latent into full keys and values (a
  prefill form): its rows differ from one-token decoding by float32 rounding (measured
  ~1.7e-6 in the rolled-back cache of the tiny Ling V3 checkpoint) and it costs a
  projection of the whole context per verify.
- Ling V3's `BailingMLA` multiplies the attention output by a per-head sigmoid gate
  (`g_proj`) before `dense`; Ling 2.5's `MultiLatentAttention` has no gate. Both are
  transcribed from mlx-lm 0.32.2's one-token branch, row for row.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import bailing_hybrid, bailing_moe_v3
from mlx_lm.models.base import scaled_dot_product_attention

from .cache_leaves import VERIFYING  # the one mark every absorbed attention reads


def _verifying(cache: Any) -> bool:
    return cache is not None and getattr(cache, VERIFYING, False)


def _absorbed(self: Any, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
    """[B, H, L, v_head_dim] attention output of the one-token form over a whole block."""
    B, L, _ = x.shape
    q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.qk_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_rope = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    compressed, k_rope = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    kv_latent = self.kv_a_layernorm(compressed)
    k_rope = k_rope.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    q_rope = self.rope(q_rope, offset=cache.offset)
    k_rope = self.rope(k_rope, offset=cache.offset)
    kv_latent, k_rope = cache.update_and_fetch(mx.expand_dims(kv_latent, axis=1), k_rope)
    pe_scores = (q_rope * self.scale) @ k_rope.swapaxes(-1, -2)
    if mask is not None:
        pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    output = scaled_dot_product_attention(
        self.embed_q(q_nope), kv_latent, kv_latent, cache=cache, scale=self.scale, mask=pe_scores
    )
    return self.unembed_out(output)


class AbsorbedBailingMLA(bailing_moe_v3.BailingMLA):
    """mlx-lm's Ling V3 gated latent attention, absorbed for every row of a marked verify."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] == 1 or not _verifying(cache):
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        output = _absorbed(self, x, mask, cache).transpose(0, 2, 1, 3)
        gate = mx.sigmoid(self.g_proj(x).astype(mx.float32)).astype(output.dtype)
        return self.dense((output * gate[..., None]).reshape(B, L, -1))


class AbsorbedBailingHybridMLA(bailing_hybrid.MultiLatentAttention):
    """mlx-lm's Ling 2.5 latent attention, absorbed for every row of a marked verify."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] == 1 or not _verifying(cache):
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        return self.dense(_absorbed(self, x, mask, cache).transpose(0, 2, 1, 3).reshape(B, L, -1))


# mlx-lm class -> its absorbed-verify subclass (merged into absorbed_mla.ABSORBED).
ABSORBED: dict[type, type] = {
    bailing_moe_v3.BailingMLA: AbsorbedBailingMLA,
    bailing_hybrid.MultiLatentAttention: AbsorbedBailingHybridMLA,
}
