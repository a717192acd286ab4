"""GLM-4 MoE Lite (GLM-4.7-Flash layout) MTP head: the DeepSeek-V3 head around a GLM MLA layer.

Rules:
- Wiring and chaining are deepseek_v3's (``eh_proj(cat[enorm(emb), hnorm(h)])`` ->
  decoder layer -> ``shared_head``; PRE-norm chained hidden); raw keys
  ``model.layers.{num_hidden_layers + j}.*`` mapped by deepseek_v3's ``from_hf``
  (experts stacked, ``kv_b_proj`` split into ``embed_q`` / ``unembed_out``).
- The layer is mlx-lm's own ``Glm4MoeLiteDecoderLayer`` (latent attention + sigmoid-routed
  MoE with shared experts) at index ``num_hidden_layers``; latent attention wants a
  boolean array mask, as DeepSeek's does.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.nn as nn
from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteDecoderLayer

from . import deepseek_v3


class MTPHead(deepseek_v3.MTPHead):
    FAMILY: ClassVar[str] = "glm4_moe_lite"

    def _make_block(self, args: Any) -> nn.Module:
        return Glm4MoeLiteDecoderLayer(args, layer_idx=args.num_hidden_layers)


is_head_key = deepseek_v3.is_head_key
from_hf = deepseek_v3.from_hf
