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

from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.ernie4_5_moe import Ernie4_5_DecoderLayer, Ernie4_5_MLP

from ._base import MTPHeadBase

_GROUPS = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj", "mtp_block")


class MTPHead(MTPHeadBase):
    FAMILY: ClassVar[str] = "ernie4_5_moe"
    CHAIN_POST_NORM: ClassVar[bool] = False
    CONCAT_ORDER: ClassVar[str] = "embedding_first"

    def __init__(
        self,
        args: Any,
        embed_tokens: nn.Module,
        lm_head: Callable[[mx.array], mx.array],
        final_norm: Callable[[mx.array], mx.array] | None = None,
    ) -> None:
        super().__init__(embed_tokens, lm_head)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.mtp_emb_norm = nn.RMSNorm(d, eps=eps)
        self.mtp_hidden_norm = nn.RMSNorm(d, eps=eps)
        self.mtp_linear_proj = nn.Linear(2 * d, d, bias=args.use_bias)
        self.mtp_block = Ernie4_5_DecoderLayer(args, layer_idx=0)
        self.mtp_block.mlp = Ernie4_5_MLP(d, args.intermediate_size, args.use_bias)  # dense, always
        # the main model's final norm, held by reference (not a head parameter)
        self._shared.final_norm = final_norm if final_norm is not None else (lambda h: h)

    @classmethod
    def from_model(cls, model: nn.Module, *, own_lm_head: bool = False) -> MTPHead:
        from ...runtime.hidden import main_parts

        parts = main_parts(model)
        return cls(parts.args, parts.embed_tokens, parts.lm_head, parts.inner.norm)

    def trunk(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list[Any] | None = None,
        mask: Any = None,
    ) -> mx.array:
        e = self.mtp_emb_norm(self.embed(next_tokens))
        h = self.mtp_hidden_norm(hidden)
        x = self.mtp_linear_proj(mx.concatenate([e, h], axis=-1))
        c = self._first(cache)
        if mask is None:
            mask = create_attention_mask(x, c)
        return self.mtp_block(x, mask, c)  # pre-norm: what depth k > 1 chains

    def logits(self, head_hidden: mx.array) -> mx.array:
        return self.main_lm_head(self._shared.final_norm(head_hidden))


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
