"""DeepSeek-V3 MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> MLA+MoE decoder layer
-> ``shared_head.norm`` -> ``shared_head.head``.

Rules:
- Concatenation is embedding first. The chained hidden is the PRE-norm decoder output
  (vLLM reuses the one layer on it and applies ``shared_head.norm`` only for logits).
- Raw keys: ``model.layers.{num_hidden_layers + j}.*``. ``embed_tokens`` there is a copy of
  the main embedding and is not loaded (the main one is shared). The decoder part maps to
  ``block.*`` (mlx-lm's ``DeepseekV3DecoderLayer``), and gets the same treatment mlx-lm's
  ``sanitize`` gives the main layers, which it skips for the head: fp8 block dequant,
  per-expert tensors stacked into ``switch_mlp``, ``kv_b_proj`` split into
  ``embed_q``/``unembed_out``.
- ``shared_head.head`` is the head's own output matrix when the checkpoint ships it
  (equal to the main lm_head in released checkpoints); with ``own_lm_head=False`` the
  main lm_head is used instead (saves vocab x hidden memory).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

from . import mapping
from .trunk import FusedTrunkHead

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_DROP = ("embed_tokens.", mapping.ROPE_TABLE)


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "deepseek_v3"
    CHAIN_POST_NORM: ClassVar[bool] = False  # the block output; shared_head.norm only for logits
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    HAS_OWN_LM_HEAD: ClassVar[bool] = True  # shared_head.head
    SHARED_HEAD_NORM: ClassVar[bool] = True
    MASK_ARRAY: ClassVar[bool] = True  # MLA

    def _make_block(self, args: Any) -> nn.Module:
        # index num_hidden_layers: mlx-lm then picks MoE exactly as HF does for the head
        return DeepseekV3DecoderLayer(args, layer_idx=args.num_hidden_layers)


is_head_key = mapping.is_appended_layer_key


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    w = mapping.layer_tensors(raw, mapping.appended_layer_prefix(config, layer), _OWN, drop=_DROP)
    w = mapping.dequant_fp8(w)
    mapping.stack_experts(w, "block.mlp", int(config.get("n_routed_experts") or 0))
    mapping.split_kv_b(w, config)
    return w
