"""DeepSeek sparse attention (DSA) verified query by query, as mlx-lm decodes one token.

Rules of this module:
- mlx-lm's deepseek_v32 attention (glm_moe_dsa is built on it) keeps two caches per
  layer, ``CacheList(latent KVCache, indexer KVCache)``. For one query token its
  lightning indexer scores every cached key, and when there are more than
  ``index_topk`` keys the query attends to the top-k only (``argpartition``), in the
  absorbed latent form. For several tokens it scores the whole block at once and runs
  the expanded (prefill) form: different arithmetic, and a different ``argpartition``
  input (a longer row, masked tail), so a tie in the indexer scores may keep other keys
  than the one-token step would. A verify must be the one-token decode at every
  position.
- `DsaVerifyAttention` (a subclass of mlx-lm's class installed by
  melix_mlx.runtime.absorbed_mla, which marks the caches of a verify) appends the
  block's latents and indexer keys exactly as the one-token steps would, then runs
  each query i of the block on the cache prefix a one-token decode at that position
  sees (``T - L + i + 1`` entries: later verify keys are outside it, in the indexer's
  scores too): the same indexer scores, the same ``index_topk`` threshold, the same
  ``argpartition`` row, the same gathered keys and the same absorbed attention. Each
  position is therefore bit-equal to the one-token step. The leading queries whose step
  keeps every key (``seen <= index_topk``: no indexer scores at all) run together, in
  the absorbed form over the block prefix with the causal mask, as
  melix_mlx.runtime.absorbed_mla verifies DeepSeek-V3 (bit-equal on the CPU wheel, as
  the tests check). Unmarked (a prefill, a plain decode step) it is mlx-lm's
  ``__call__`` unchanged; it adds no parameters.
- Batched caches: the mask row of query i restricted to its prefix is the mask the
  one-token step builds (left padding, rolled-back holes), applied before the top-k
  exactly as mlx-lm does, so padding and holes only fill a top-k whose row has fewer
  live keys than ``index_topk`` and are then masked out of the attention.
- Rollback: both sub-caches are KV caches written in lockstep, so trimming (or, batched,
  dropping row suffixes from) every leaf of the ``CacheList`` restores both exactly.
- A single sequence stays in mlx-lm's own cache form (melix_mlx.decode moves only plain
  KV / recurrent caches to the one-row batch form): there a rolled-back hole would sit
  in the indexer's row and in the ``index_topk`` count, and the step would no longer be
  mlx-lm's one-token step bit for bit (the same keys, but gathered in another order).
  Batched rows are held to the same keys as alone, not to the same bits (as every
  family's batched rows are to their padding); an exact tie in the indexer's scores at
  the top-k boundary may be broken differently in a padded row, as in mlx-lm's own
  batched decoding.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v32
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention

VERIFYING = "melix_verifying"  # attribute a KV cache leaf carries during a verify forward


def _gather(x: mx.array, idx: mx.array) -> mx.array:
    """x [B, 1, T, d] at key indices idx [B, 1, k, 1] -> [B, 1, k, d]."""
    return mx.take_along_axis(x, mx.broadcast_to(idx, idx.shape[:-1] + (x.shape[-1],)), axis=2)


def _lowest(x: mx.array) -> mx.array:
    return mx.array(mx.finfo(x.dtype).min, x.dtype)


def top_keys(q: mx.array, keys: mx.array, weights: mx.array, row: mx.array | None, k: int) -> mx.array:
    """The k keys one query keeps [B, 1, 1, k], computed as mlx-lm's one-token indexer does.

    q [B, heads, 1, d] and keys [B, 1, seen, d] (RoPE applied), weights [B, 1, heads]
    (already scaled), row [B, 1, 1, seen] (the step's mask, or None).
    """
    scores = mx.maximum(q @ keys.swapaxes(-1, -2), 0)
    scores = (scores * weights.swapaxes(-1, -2)[..., None]).sum(axis=1, keepdims=True)
    if row is not None:
        scores = mx.where(row, scores, -float("inf"))
    return mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]


def _verify_call(self: Any, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
    B, L, _ = x.shape
    latent_cache, index_cache = cache[0], cache[1]
    qr = self.q_a_layernorm(self.q_a_proj(x))
    q = self.q_b_proj(qr).reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    compressed_kv = self.kv_a_proj_with_mqa(x)
    compressed_kv, k_pe = mx.split(compressed_kv, [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    kv_latent = self.kv_a_layernorm(compressed_kv)
    offset = latent_cache.offset
    q_pe = self.rope(q_pe, offset)
    k_pe = self.rope(k_pe, offset)
    kv_latent, k_pe = latent_cache.update_and_fetch(mx.expand_dims(kv_latent, axis=1), k_pe)

    # the indexer's side of the block, appended as the one-token steps append it
    ix = self.indexer
    iq = ix.wq_b(qr).reshape(B, L, ix.n_heads, ix.head_dim).swapaxes(1, 2)
    ik = ix.k_norm(ix.wk(x)).reshape(B, 1, L, ix.head_dim)
    index_offset = index_cache.offset
    iq = ix.rope(iq, offset=index_offset)
    ik = ix.rope(ik, offset=index_offset)
    ik, _ = index_cache.update_and_fetch(ik, ik)
    index_cache.values = mx.zeros_like(index_cache.keys)  # as mlx-lm keeps it
    weights = ix.weights_proj(x) * (ix.n_heads**-0.5 * ix.softmax_scale)  # [B, L, heads]

    q_abs = self.embed_q(q_nope)
    total = kv_latent.shape[2]
    outputs = []
    # queries whose step keeps every key (seen <= index_topk): the absorbed form over the
    # block prefix at once, as melix_mlx.runtime.absorbed_mla verifies DeepSeek-V3
    dense = max(0, min(L, ix.index_topk - (total - L)))
    if dense:
        seen = total - L + dense
        rows = create_causal_mask(dense, total - L) if mask is None else mask[..., :dense, :seen]
        pe_scores = (q_pe[:, :, :dense] * self.scale) @ k_pe[:, :, :seen].swapaxes(-1, -2)
        pe_scores = mx.where(rows, pe_scores, _lowest(pe_scores))
        latent = kv_latent[:, :, :seen]
        outputs.append(
            scaled_dot_product_attention(
                q_abs[:, :, :dense], latent, latent, cache=cache, scale=self.scale, mask=pe_scores
            )
        )
    for i in range(dense, L):  # the rest keep their own top-k: one query at a time
        seen = total - L + i + 1  # the cache a one-token step at this position holds
        # the one-token step's mask: [B, 1, 1, seen] (a single sequence's causal rows are all True)
        row = None if mask is None else mx.broadcast_to(mask[..., i : i + 1, :seen], (B, 1, 1, seen))
        w = weights[:, i : i + 1]
        top = top_keys(iq[:, :, i : i + 1], ik[:, :, :seen], w, row, ix.index_topk)
        idx = top[:, :, 0, :, None]
        latent, pe = _gather(kv_latent[:, :, :seen], idx), _gather(k_pe[:, :, :seen], idx)
        pe_scores = (q_pe[:, :, i : i + 1] * self.scale) @ pe.swapaxes(-1, -2)
        if row is not None:
            pe_scores = mx.where(mx.take_along_axis(row, top, axis=-1), pe_scores, _lowest(pe_scores))
        outputs.append(
            scaled_dot_product_attention(
                q_abs[:, :, i : i + 1], latent, latent, cache=cache, scale=self.scale, mask=pe_scores
            )
        )
    latent_cache.keys = mx.depends(latent_cache.keys, (index_cache.keys, index_cache.values))
    output = self.unembed_out(mx.concatenate(outputs, axis=2))
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DsaVerifyAttention(deepseek_v32.DeepseekV32Attention):
    """mlx-lm's DSA attention, one-token form per query of a marked verify."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if x.shape[1] == 1 or cache is None or not getattr(cache[0], VERIFYING, False):
            return super().__call__(x, mask, cache)
        return _verify_call(self, x, mask, cache)
