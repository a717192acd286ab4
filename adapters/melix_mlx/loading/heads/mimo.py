"""MiMo MTP head: ``input_proj(cat[hidden_norm(h), token_norm(emb)])`` -> qwen2 layer.

Rules:
- Concatenation is HIDDEN first (unlike DeepSeek/Qwen); the head ends in
  ``final_layernorm`` and the shared main lm_head; the chained hidden is POST-norm.
- Norms are plain RMSNorm weights (no +1). Raw keys: ``model.mtp_layers.{i}.*``; the
  decoder part (``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``)
  maps to ``block.*``, mlx-lm's ``mimo.TransformerBlock``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.mimo import TransformerBlock

from ._base import MTPHeadBase

_PREFIX = "model.mtp_layers."
_OWN = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


class MTPHead(MTPHeadBase):
    FAMILY: ClassVar[str] = "mimo"
    CHAIN_POST_NORM: ClassVar[bool] = True
    CONCAT_ORDER: ClassVar[str] = "hidden_first"

    def __init__(self, args: Any, embed_tokens: nn.Module, lm_head: Callable[[mx.array], mx.array]) -> None:
        super().__init__(embed_tokens, lm_head)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.token_layernorm = nn.RMSNorm(d, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(d, eps=eps)
        self.input_proj = nn.Linear(2 * d, d, bias=False)
        self.block = TransformerBlock(args)
        self.final_layernorm = nn.RMSNorm(d, eps=eps)

    def trunk(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list[Any] | None = None,
        mask: Any = None,
    ) -> mx.array:
        h = self.hidden_layernorm(hidden)
        e = self.token_layernorm(self.embed(next_tokens))
        x = self.input_proj(mx.concatenate([h, e], axis=-1))
        c = self._first(cache)
        if mask is None:
            mask = create_attention_mask(x, c)
        x = self.block(x, mask, c)
        out = self.final_layernorm(x)
        return out  # post-norm: the lm_head input, chained as is

    def logits(self, head_hidden: mx.array) -> mx.array:
        return self.main_lm_head(head_hidden)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return key.startswith(_PREFIX)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF head tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    prefix = f"{_PREFIX}{layer}."
    out: dict[str, mx.array] = {}
    for key, value in raw.items():
        if not key.startswith(prefix) or "rotary_emb.inv_freq" in key:
            continue
        name = key[len(prefix) :]
        out[name if name.startswith(_OWN) else f"block.{name}"] = value
    return out
