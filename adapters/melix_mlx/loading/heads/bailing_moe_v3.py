"""Bailing MoE V3 (Ling V3) MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> MLA + MoE
decoder layer -> ``final_layernorm`` -> the main ``lm_head``.

What the published sources give (facts, read in vLLM's
``vllm/model_executor/models/bailing_moe_v3_mtp.py``, the Ling V3 configuration
``configuration_bailing_moe_v3.py`` and mlx-lm 0.32.2's ``models/bailing_moe_v3.py``):
- Weight names: head layer j at ``model.layers.{num_hidden_layers + j}.``: ``enorm``,
  ``hnorm``, ``eh_proj`` (2D -> D, no bias), ``input_layernorm``, ``attention.*`` (the
  main MLA layers' names: ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` unsplit, the per-head output
  gate ``g_proj``, output ``dense``), ``post_attention_layernorm``, ``mlp.*`` (router
  ``gate.weight`` and ``gate.expert_bias`` (vLLM also accepts
  ``e_score_correction_bias``), per-expert ``experts.{e}.{gate,up,down}_proj``,
  ``shared_experts``), ``final_layernorm``. mlx-lm's ``sanitize`` drops every
  ``model.layers.{i >= num_hidden_layers}`` key (``_is_mtp_weight``).
- The head layer is full (latent) attention even where the main pattern would put a KDA
  layer (config ``mtp_use_kda = false``) and always MoE; mlx-lm's ``BailingDecoderLayer``
  built at index ``num_hidden_layers`` picks exactly that (its KDA rule excludes indices
  past the last whole group).
- Norms are plain RMSNorm weights (no +1). Concatenation is embedding first.
- vLLM's layer returns ``final_layernorm(decoder output)`` and its shared head is only the
  output matrix (``shared_head.head``, which vLLM fills from the main ``lm_head.weight``):
  logits = ``lm_head(final_layernorm(x))``. The chained hidden is that POST-norm output
  (the proposer feeds the layer's return value back as the previous hidden).
- The head reads the main model's final post-norm hidden state (the lm_head input).
- Depth > 1 chains the one layer (``spec_step_idx % num_nextn_predict_layers``); several
  trained layers load as ``stacked.StackedHead``.
- The embedding is the main model's ``model.word_embeddings`` (shared; copies stored with
  the head, if any, are not loaded). A stored ``shared_head.head`` is used when present
  and ``own_lm_head`` asks for it; otherwise the main lm_head, as vLLM does.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import bailing_moe_v3

from . import mapping
from .trunk import FusedTrunkHead

_OWN = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.", "shared_head.")
_DROP = ("embed_tokens.", "word_embeddings.", mapping.ROPE_TABLE)


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "bailing_moe_v3"
    CHAIN_POST_NORM: ClassVar[bool] = True  # final_layernorm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    HAS_OWN_LM_HEAD: ClassVar[bool] = True  # shared_head.head, when stored
    FINAL_NORM: ClassVar[str | None] = "final_layernorm"
    SHARED_HEAD_NORM: ClassVar[bool] = False  # Ling 2.5 applies deepseek_mtp's shared_head.norm
    MASK_ARRAY: ClassVar[bool] = True  # MLA
    BLOCK_PARTS: ClassVar[tuple[str, str, str, str] | None] = (
        "input_layernorm",
        "attention",
        "post_attention_layernorm",
        "mlp",
    )

    def _make_block(self, args: Any) -> nn.Module:
        # index num_hidden_layers: mlx-lm then builds latent attention and MoE, as the head has
        return bailing_moe_v3.BailingDecoderLayer(args, args.num_hidden_layers)


is_head_key = mapping.is_appended_layer_key


def _rename(name: str) -> str:
    return name.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")


def layer_tensors(raw: dict[str, mx.array], config: dict[str, Any], layer: int) -> dict[str, mx.array]:
    """Raw tensors of head layer ``layer`` under head names (own names kept, the decoder
    layer's under ``block.``), copies of the shared embedding dropped."""
    prefix = mapping.appended_layer_prefix(config, layer)
    return mapping.layer_tensors(raw, prefix, _OWN, drop=_DROP, rename=_rename)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names (experts
    stacked and ``kv_b_proj`` split, as mlx-lm's ``sanitize`` does for the main layers)."""
    w = layer_tensors(raw, config, layer)
    mapping.stack_experts(w, "block.mlp", int(config.get("num_experts") or 0))
    mapping.split_kv_b(w, config, attention="attention")
    return w
