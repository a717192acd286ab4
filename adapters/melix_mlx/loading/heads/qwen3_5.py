"""Qwen3.5 MTP head: ``fc(cat[norm_e(emb), norm_h(h)])`` -> full-attention layer -> norm.

Rules:
- Concatenation is embedding first; the chained hidden is the POST-norm output (what
  upstream's MTP forward returns).
- HF stores every RMSNorm of the head as w with forward (1+w): ``from_hf`` adds 1 exactly
  once. Raw keys live under ``mtp.`` (possibly in a ``mtp.safetensors`` sidecar).
- The layer is mlx-lm's own ``qwen3_5.DecoderLayer`` built as a full-attention layer, so
  parameter names and numerics match the main model's attention layers (a sparse-MoE
  feed-forward when the config has experts: qwen3_5_moe subclasses this head).
- Expert tensors are stacked into ``switch_mlp`` from either stored form: fused
  (``experts.gate_up_proj`` [E, 2I, D] + ``experts.down_proj``) or per expert
  (``experts.{e}.{gate,up,down}_proj.*``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_5 import DecoderLayer

from . import mapping
from .trunk import FusedTrunkHead

# Raw checkpoints may prefix the head differently depending on who saved them.
_PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp.")
_ONE_PLUS_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "qwen3_5"
    CHAIN_POST_NORM: ClassVar[bool] = True  # norm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    EMB_NORM, HIDDEN_NORM, PROJ = "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc"
    BLOCK, FINAL_NORM = "layers", "norm"

    def _make_block(self, args: Any) -> nn.Module:
        # layer_idx chosen so that mlx-lm builds a full-attention (not linear) layer
        return DecoderLayer(args, layer_idx=args.full_attention_interval - 1)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith(_PREFIXES)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF head tensors to ``MTPHead`` parameter names, repairing (1+w) norms."""
    out = {
        name: value + 1.0 if value.ndim == 1 and name.endswith(_ONE_PLUS_NORMS) else value
        for name, value in mapping.module_layer_tensors(raw, _PREFIXES, layer).items()
    }
    _unfuse_experts(out, "layers.0.mlp")
    mapping.stack_experts(out, "layers.0.mlp", int(config.get("num_experts") or 0))
    return out


def _unfuse_experts(w: dict[str, mx.array], mlp: str) -> None:
    """Fused expert tensors (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj``)
    -> ``{mlp}.switch_mlp.{proj}.weight``, in place (per-expert ones are stacked after)."""
    fused = w.pop(f"{mlp}.experts.gate_up_proj", None)
    if fused is not None:
        mid = fused.shape[-2] // 2
        w[f"{mlp}.switch_mlp.gate_proj.weight"] = fused[..., :mid, :]
        w[f"{mlp}.switch_mlp.up_proj.weight"] = fused[..., mid:, :]
    if f"{mlp}.experts.down_proj" in w:
        w[f"{mlp}.switch_mlp.down_proj.weight"] = w.pop(f"{mlp}.experts.down_proj")
