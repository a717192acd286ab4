"""ERNIE-4.5 MoE MTP head: ``mtp_linear_proj(cat[mtp_emb_norm(emb), mtp_hidden_norm(h)])``
-> one dense ERNIE decoder layer (``mtp_block``) -> the main model's final norm -> lm_head.

Rules:
- Raw keys, per head layer j (the index follows each module name, not a layer prefix):
  ``model.mtp_emb_norm.{j}.weight``, ``model.mtp_hidden_norm.{j}.weight``,
  ``model.mtp_linear_proj.{j}.weight`` [D, 2D] (``.bias`` only when ``use_bias``) and
  ``model.mtp_block.{j}.*``. mlx-lm's ``ernie4_5_moe.sanitize`` drops all four groups.
- Concatenation is embedding first. Norms are plain RMSNorm weights (no +1), eps
  ``rms_norm_eps``.
- ``mtp_block`` is an ERNIE decoder layer whose feed-forward is DENSE (``mlp.gate_proj /
  up_proj / down_proj`` of ``intermediate_size``, as vLLM's and SGLang's MTP layers build
  it and load the published tensors into), attention as in the main layers (GQA,
  interleaved RoPE, ``use_bias``).
- The head has no output norm of its own: its block output goes through the main model's
  final ``model.norm`` and then the main lm_head (tied or not). That is the training
  code's form (every MTP output is normed by the shared final norm before the shared
  lm_head) and Baidu's serving engine's; vLLM's and SGLang's ports skip the norm.
- The embedding and lm_head are the main model's. The hidden state read is the main
  model's post-norm one: what the serving engines (vLLM, SGLang, FastDeploy) pass and this
  project's head interface gives (the training loop feeds the last layer's output before
  the final norm: after ``mtp_hidden_norm`` the two differ by the final norm's weight).
  Depth k > 1 chains the PRE-norm block output (the training loop feeds the block output
  to the next depth's ``mtp_hidden_norm``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.ernie4_5_moe import Ernie4_5_DecoderLayer, Ernie4_5_MLP

from .trunk import FusedTrunkHead

_GROUPS = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj", "mtp_block")


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "ernie4_5_moe"
    CHAIN_POST_NORM: ClassVar[bool] = False  # the block output
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    EMB_NORM, HIDDEN_NORM, PROJ, BLOCK = _GROUPS
    PROJ_BIAS: ClassVar[str | None] = "use_bias"
    READS_MAIN_NORM: ClassVar[bool] = True  # the main model's final norm, before the lm_head

    def _make_block(self, args: Any) -> nn.Module:
        block = Ernie4_5_DecoderLayer(args, layer_idx=0)
        block.mlp = Ernie4_5_MLP(args.hidden_size, args.intermediate_size, args.use_bias)  # dense, always
        return block

    def logits(self, head_hidden: mx.array) -> mx.array:
        return self.main_lm_head(self._main.norm(head_hidden))


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return any(key.startswith(f"model.{g}.") for g in _GROUPS)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    out: dict[str, mx.array] = {}
    for group in _GROUPS:
        prefix = f"model.{group}.{layer}."
        for key, value in raw.items():
            if key.startswith(prefix) and "rotary_emb.inv_freq" not in key:
                out[f"{group}.{key[len(prefix) :]}"] = value
    return out
