"""GLM-4.5/4.6 MoE MTP head: the DeepSeek-V3 head shape around a GLM-4 MoE decoder layer.

Rules:
- Same wiring as deepseek_v3: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> decoder layer ->
  ``shared_head.norm`` -> ``shared_head.head`` (or the main lm_head); the chained hidden
  is the PRE-norm decoder output.
- The decoder layer is mlx-lm's own ``glm4_moe.DecoderLayer`` (grouped-query attention
  with partial RoPE and optional q/k norms, sigmoid-routed experts plus shared experts),
  built at index ``num_hidden_layers`` so mlx-lm picks the MoE feed-forward as the
  checkpoint does. It has no latent attention: the mask is mlx-lm's ordinary one.
- Raw keys: ``model.layers.{num_hidden_layers + j}.*``, mapped exactly like deepseek_v3
  (per-expert tensors stacked into ``switch_mlp``; there is no ``kv_b_proj`` to split).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.nn as nn
from mlx_lm.models.glm4_moe import DecoderLayer

from . import deepseek_v3


class MTPHead(deepseek_v3.MTPHead):
    FAMILY: ClassVar[str] = "glm4_moe"
    MASK_ARRAY: ClassVar[bool] = False  # ordinary attention: mlx-lm's own mask

    def _make_block(self, args: Any) -> nn.Module:
        return DecoderLayer(args, layer_idx=args.num_hidden_layers)


is_head_key = deepseek_v3.is_head_key
from_hf = deepseek_v3.from_hf
