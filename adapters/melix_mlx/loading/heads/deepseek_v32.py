"""DeepSeek-V3.2 MTP head: the DeepSeek-V3 head around a sparse-attention (DSA) layer.

Rules:
- Wiring is deepseek_v3's: ``x = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])``
  (embedding first; ``enorm``/``hnorm``/``shared_head.norm`` are plain RMSNorms, weight
  as stored, no +1), one decoder layer, then ``shared_head.norm`` -> ``shared_head.head``
  (or the main lm_head). ``h_i`` is the main model's final POST-norm hidden state (the
  lm_head input). Depth k > 1 chains the PRE-norm decoder output (the layer's residual
  stream, before ``shared_head.norm``), as vLLM's deepseek_mtp reuses its one layer.
- The layer is mlx-lm's own ``DeepseekV32DecoderLayer`` at index ``num_hidden_layers``
  (latent attention with its own lightning indexer, sigmoid-routed MoE with shared
  experts). Its cache is ``CacheList(latent KVCache, indexer KVCache)``, as mlx-lm gives
  every main layer; the mask is built over the latent part (``cache[0]``), as mlx-lm's
  model does. A verify-shaped call (the engine's catch-up) runs the one-token form per
  query (melix_mlx.runtime.dsa); trimming the ``CacheList`` trims both parts.
- Raw keys: ``model.layers.{num_hidden_layers + j}.*`` (mlx-lm's deepseek_v32 ``sanitize``
  drops every layer index >= ``num_hidden_layers``): ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.{norm, head}``, a copy of ``embed_tokens`` (not loaded: the main
  embedding is shared), and the decoder layer's tensors including
  ``self_attn.indexer.{wq_b, wk, k_norm.{weight, bias}, weights_proj}``. They are mapped
  by deepseek_v3's ``from_hf`` (fp8 block dequant, experts stacked into ``switch_mlp``,
  ``kv_b_proj`` split into ``embed_q``/``unembed_out``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache
from mlx_lm.models.deepseek_v32 import DeepseekV32DecoderLayer

from . import deepseek_v3


class MTPHead(deepseek_v3.MTPHead):
    FAMILY: ClassVar[str] = "deepseek_v32"

    def _make_block(self, args: Any) -> nn.Module:
        return DeepseekV32DecoderLayer(args, layer_idx=args.num_hidden_layers)

    def _mask(self, x: mx.array, cache: Any) -> Any:
        # mlx-lm masks DSA over the latent cache (the CacheList's first part)
        return create_attention_mask(x, cache[0] if cache is not None else None, return_array=True)

    def make_cache(self) -> list[Any]:
        return [CacheList(KVCache(), KVCache()) for _ in range(self.NUM_LAYERS)]


is_head_key = deepseek_v3.is_head_key
from_hf = deepseek_v3.from_hf
