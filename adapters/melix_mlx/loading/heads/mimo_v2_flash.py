"""MiMo-V2-Flash MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> sliding-window
decoder layer -> ``final_layernorm`` -> the main lm_head.

Rules (facts from the published reference, vLLM's mimo_v2_mtp):
- Raw keys: ``model.mtp.layers.{j}.*`` (mlx-lm's ``sanitize`` drops every key starting
  ``model.mtp``): ``enorm``, ``hnorm``, ``eh_proj`` [D, 2D], ``input_layernorm``,
  ``self_attn.{q,k,v,o}_proj`` (+ ``attention_sink_bias`` when the config's
  ``add_swa_attention_sink_bias``), ``pre_mlp_layernorm``, a dense
  ``mlp.{gate,up,down}_proj`` of ``intermediate_size`` and ``final_layernorm``. fp8
  checkpoints carry ``*.weight_scale_inv`` block scales, dequantized here as mlx-lm
  dequantizes the main layers. No embedding or lm_head of its own: the main ones are
  shared.
- Norms are plain RMSNorm weights (no +1), eps ``layernorm_epsilon``.
- Concatenation is embedding first. The head reads the main model's POST-norm hidden
  (the model's forward returns its final norm's output).
- The attention is the sliding-window configuration (``swa_*`` heads and dims,
  ``swa_rope_theta``, partial RoPE, value scale, sink bias), windowed at
  ``sliding_window_size``: mlx-lm's ``mimo_v2_flash.DecoderLayer`` built as a sliding
  layer (``post_attention_layernorm`` there is ``pre_mlp_layernorm`` here). Its cache is
  a window that evicts nothing (melix_mlx.runtime.window_kv ``unevicted``), so the chained
  drafts and rollbacks trim it exactly, and batches merge it into the batch window form.
- The layer returns ``final_layernorm``'s output, which is both the lm_head input and
  what depth k > 1 chains (post-norm). Released configs write no head count: one head
  layer is read (vLLM drives layer 0 for every depth too).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mimo_v2_flash import DecoderLayer

from . import mapping
from .trunk import FusedTrunkHead

_PREFIX = "model.mtp.layers."
_OWN = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")
_RENAME = (("pre_mlp_layernorm.", "post_attention_layernorm."),)


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "mimo_v2_flash"
    CHAIN_POST_NORM: ClassVar[bool] = True  # final_layernorm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    FINAL_NORM: ClassVar[str | None] = "final_layernorm"
    EPS: ClassVar[str] = "layernorm_epsilon"

    def _make_block(self, args: Any) -> nn.Module:
        return DecoderLayer(args, is_moe=False, is_sliding_window=True)

    def _window(self, args: Any) -> int | None:
        return args.sliding_window_size


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith("model.mtp.")


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    prefix = f"{_PREFIX}{layer}."
    return mapping.dequant_fp8(
        mapping.layer_tensors(raw, prefix, _OWN, rename=lambda n: mapping.renamed(n, _RENAME))
    )
