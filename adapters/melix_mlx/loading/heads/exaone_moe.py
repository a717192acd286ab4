"""EXAONE MoE (K-EXAONE) MTP head: ``fc(cat[pre_fc_norm_embedding(emb),
pre_fc_norm_hidden(h)])`` -> one dense decoder layer -> ``norm`` -> the main lm_head.

Rules (facts from the published reference, vLLM's exaone_moe_mtp and exaone_moe):
- Raw keys under ``mtp.`` (mlx-lm's ``sanitize`` drops every key starting ``mtp.``):
  ``mtp.fc`` [D, 2D], ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.norm`` and ``mtp.layers.{j}.*`` (``self_attn.{q,k,v,o}_proj``, ``q_norm``,
  ``k_norm``, ``input_layernorm``, ``post_attention_layernorm``, a dense
  ``mlp.{gate,up,down}_proj`` of ``intermediate_size``: an MTP layer is never sparse).
  Embedding and lm_head are the main model's.
- Norms are plain RMSNorm weights (no +1). Concatenation is embedding first.
- The head reads the main model's POST-norm hidden (the model's forward returns its
  final norm's output); the layer's output goes through ``norm``, which is both the
  lm_head input and what depth k > 1 chains (post-norm).
- The head layer's attention is full attention without RoPE: released configs say
  ``mtp_layer_types: ["full_attention"]`` and ``mtp_sliding_windows: [0]``, and a full
  layer of a model with sliding layers applies no rotary embedding (mlx-lm's
  ``exaone_moe.Attention`` rule). mlx-lm's ModelArgs does not carry ``mtp_layer_types``,
  so this module builds that layer: mlx-lm's ``exaone_moe.DecoderLayer`` at an index
  whose type is full attention and whose MLP is dense. Its cache is a plain KVCache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.exaone_moe import DecoderLayer

from . import mapping
from .trunk import FusedTrunkHead

_PREFIX = "mtp."


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "exaone_moe"
    CHAIN_POST_NORM: ClassVar[bool] = True  # norm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    EMB_NORM, HIDDEN_NORM, PROJ = "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc"
    BLOCK, FINAL_NORM = "layers", "norm"

    def _make_block(self, args: Any) -> nn.Module:
        # index 0 of a layer list led by the head's own (full, dense) entry; the main
        # model's types follow, so "does the model have sliding layers" reads as upstream
        head_args = dataclasses.replace(
            args,
            layer_types=["full_attention", *args.layer_types],
            is_moe_layer=[False, *args.is_moe_layer],
        )
        return DecoderLayer(head_args, 0)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith(_PREFIX)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF head tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    return mapping.module_layer_tensors(raw, (_PREFIX,), layer, drop=(mapping.ROPE_TABLE,))
