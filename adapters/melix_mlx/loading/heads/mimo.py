"""MiMo MTP head: ``input_proj(cat[hidden_norm(h), token_norm(emb)])`` -> qwen2 layer.

Rules:
- Concatenation is HIDDEN first (unlike DeepSeek/Qwen); the head ends in
  ``final_layernorm`` and the shared main lm_head; the chained hidden is POST-norm.
- Norms are plain RMSNorm weights (no +1). Raw keys: ``model.mtp_layers.{i}.*``; the
  decoder part (``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``)
  maps to ``block.*``, mlx-lm's ``mimo.TransformerBlock``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mimo import TransformerBlock

from . import mapping
from .trunk import FusedTrunkHead

_PREFIX = "model.mtp_layers."
_OWN = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "mimo"
    CHAIN_POST_NORM: ClassVar[bool] = True  # final_layernorm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "hidden_first"
    EMB_NORM, HIDDEN_NORM, PROJ = "token_layernorm", "hidden_layernorm", "input_proj"
    FINAL_NORM: ClassVar[str | None] = "final_layernorm"

    def _make_block(self, args: Any) -> nn.Module:
        return TransformerBlock(args)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith(_PREFIX)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF head tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    return mapping.layer_tensors(raw, f"{_PREFIX}{layer}.", _OWN)
