"""LongCat-Flash MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> one dense latent-attention
decoder layer -> ``final_layernorm`` -> the main lm_head.

Rules:
- Raw keys live under ``model.mtp.`` (mlx-lm's ``longcat_flash.sanitize`` drops them all):
  ``model.mtp.layers.0.enorm.m.weight`` and ``hnorm.m.weight`` (the norms sit one module
  deeper, ``.m.``), ``eh_proj.weight`` [D, 2D], ``input_layernorm``,
  ``post_attention_layernorm``, ``self_attn.*`` (q_a/q_b/kv_a/kv_b/o projections and the
  two low-rank norms), ``transformer_layer.mlp.{gate,up,down}_proj`` (a DENSE MLP of
  ``ffn_hidden_size``: the head has no experts), and ``model.mtp.norm.weight``, the head's
  final norm. ``model.mtp.embed_tokens.weight`` is a copy of the embedding and is not
  loaded: the main one is shared, as is the main lm_head (SGLang and vLLM share both).
- Concatenation is embedding first. Norms are plain RMSNorm weights (no +1). The decoder
  layer is a single pre-norm block (attention, then MLP, each with its residual) around
  mlx-lm's own ``LongcatFlashMLA``, which applies the ``mla_scale_q_lora`` /
  ``mla_scale_kv_lora`` scales (vLLM folds them into the low-rank norm weights: the
  same product). ``kv_b_proj`` is split into ``embed_q`` / ``unembed_out`` as mlx-lm's
  sanitize does for the main layers; fp8 block-scaled tensors are dequantised.
- The head reads the main model's post-norm hidden state. Its output is
  ``final_layernorm``'s, the lm_head input, and depth k > 1 chains it as is (POST-norm:
  what vLLM's and SGLang's LongCat MTP layers return to the proposer).
- One head layer: vLLM reads ``num_nextn_predict_layers`` with a default of 1, and the
  released configs do not write it (spec/families.toml ``head_count_default``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.longcat_flash import LongcatFlashMLA, LongcatFlashMLP

from . import mapping
from .trunk import FusedTrunkHead

_PREFIX = "model.mtp."
_RENAMES = (("enorm.m.", "enorm."), ("hnorm.m.", "hnorm."), ("transformer_layer.mlp.", "block.mlp."))
_OWN = ("enorm.", "hnorm.", "eh_proj.")


class _Block(nn.Module):
    """The head's decoder layer: latent attention then a dense MLP, pre-norm residuals."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attn = LongcatFlashMLA(args)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = LongcatFlashMLP(args, is_expert=False)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "longcat_flash"
    CHAIN_POST_NORM: ClassVar[bool] = True  # final_layernorm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    FINAL_NORM: ClassVar[str | None] = "final_layernorm"
    MASK_ARRAY: ClassVar[bool] = True  # latent attention

    def _make_block(self, args: Any) -> nn.Module:
        return _Block(args)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith(_PREFIX)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    prefix = f"{_PREFIX}layers.{layer}."
    w = mapping.layer_tensors(raw, prefix, (*_OWN, "block."), rename=lambda n: mapping.renamed(n, _RENAMES))
    if not w:
        return {}  # no such layer: the loader reports it
    if (norm := raw.get(f"{_PREFIX}norm.weight")) is not None:
        w["final_layernorm.weight"] = norm
    w = mapping.dequant_fp8(w)
    mapping.split_kv_b(w, config)
    return w
