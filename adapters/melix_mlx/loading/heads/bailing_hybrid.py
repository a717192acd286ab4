"""Bailing hybrid (Ling / Ring 2.5) MTP head: the Ling V3 head wiring around a Ling 2.5
MLA + MoE layer, with deepseek_mtp's shared-head norm before the output matrix.

What the published sources give (facts, read in vLLM's
``vllm/model_executor/models/bailing_mtp.py`` (imports ``SharedHead`` from
``deepseek_mtp`` and ``BailingMoeV25DecoderLayer`` from ``bailing_moe_linear``) and
mlx-lm 0.32.2's ``models/bailing_hybrid.py`` and ``utils.MODEL_ARCHITECTURE_REMAPPING``):
- Weight names: head layer j at ``model.layers.{num_hidden_layers + j}.``: ``enorm``,
  ``hnorm``, ``eh_proj`` (2D -> D, no bias), ``final_layernorm``, ``shared_head.norm``
  (and optionally ``shared_head.head``), and the decoder layer under the main layers'
  names: ``input_layernorm``, ``attention.*`` (MLA: ``q_a_proj`` / ``q_proj``,
  ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
  ``kv_b_proj`` unsplit, output ``dense``; no output gate), ``post_attention_layernorm``,
  ``mlp.*`` (router ``gate.weight`` + ``gate.expert_bias``, per-expert tensors,
  ``shared_experts``). mlx-lm's ``sanitize`` drops every ``model.layers.{i >= N}`` key.
- vLLM builds the layer at index ``N + j`` with full attention (the default attention
  type) and MoE; mlx-lm's ``bailing_hybrid.DecoderLayer`` at index ``num_hidden_layers``
  picks the same (its linear-attention rule excludes indices past the last whole group).
- Norms are plain RMSNorm weights. Concatenation is embedding first. Forward:
  ``final_layernorm(layer(eh_proj(cat[enorm(emb), hnorm(h)])))`` is the layer's output,
  chained as the next step's previous hidden (POST ``final_layernorm``); logits are
  ``head(shared_head.norm(that))``: two RMS norms in a row, as published. vLLM fills
  ``shared_head.head`` from the target model when the checkpoint lacks it: here the main
  ``lm_head`` is used unless the checkpoint stores its own and ``own_lm_head`` asks.
  ``shared_head.norm`` is required: a checkpoint without it is refused as missing head
  weights (vLLM would run that norm at its initial weight of ones; nothing published
  says a release relies on that).
- The head reads the main model's final post-norm hidden state.
- vLLM zeroes the token embedding at position 0 (as its deepseek_mtp does); this project's
  DeepSeek-layout heads do not (slot 0 is only ever a prompt slot), and neither does this
  one: it changes draft quality at slot 0 only, never the output (verification is exact).
- Depth > 1 chains the one layer; several trained layers load as ``stacked.StackedHead``.
- Checkpoints with ``model_type = "bailing_hybrid"`` and architecture
  ``BailingMoeV3ForCausalLM`` are Ling V3 (mlx-lm loads them with ``bailing_moe_v3``):
  ``from_model`` and ``from_hf`` then give the bailing_moe_v3 head and mapping.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import bailing_hybrid
from mlx_lm.models import bailing_moe_v3 as mlx_bailing_moe_v3

from . import bailing_moe_v3, mapping
from ._base import MTPHeadBase

_V3_ARCHITECTURE = "BailingMoeV3ForCausalLM"


class MTPHead(bailing_moe_v3.MTPHead):
    FAMILY: ClassVar[str] = "bailing_hybrid"
    SHARED_HEAD_NORM: ClassVar[bool] = True

    @classmethod
    def from_model(cls, model: nn.Module, *, own_lm_head: bool = False) -> MTPHeadBase:
        if isinstance(model, mlx_bailing_moe_v3.Model):  # a Ling V3 checkpoint under this model_type
            return bailing_moe_v3.MTPHead.from_model(model, own_lm_head=own_lm_head)
        return super().from_model(model, own_lm_head=own_lm_head)

    def _make_block(self, args: Any) -> nn.Module:
        return bailing_hybrid.DecoderLayer(args, layer_idx=args.num_hidden_layers)


def _is_v3(config: dict[str, Any]) -> bool:
    return _V3_ARCHITECTURE in (config.get("architectures") or [])


is_head_key = bailing_moe_v3.is_head_key


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to head parameter names: experts stacked,
    ``kv_b_proj`` split, the router ``mlp.gate.weight`` renamed to mlx-lm's
    ``mlp.gate.gate_proj.weight`` (what mlx-lm's ``sanitize`` does for the main layers)."""
    if _is_v3(config):
        return bailing_moe_v3.from_hf(raw, config, layer)
    w = bailing_moe_v3.layer_tensors(raw, config, layer)
    for kind in ("weight", "bias"):
        if (key := f"block.mlp.gate.{kind}") in w:
            w[f"block.mlp.gate.gate_proj.{kind}"] = w.pop(key)
    mapping.stack_experts(w, "block.mlp", int(config.get("num_experts") or 0))
    mapping.split_kv_b(w, config, attention="attention")
    return w
