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

from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import bailing_moe_v3
from mlx_lm.models.base import create_attention_mask

from . import deepseek_v3
from ._base import MTPHeadBase

_OWN = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.", "shared_head.")
_DROP = ("embed_tokens.", "word_embeddings.", "rotary_emb.inv_freq")


class _SharedHead(nn.Module):
    def __init__(self, dim: int, vocab: int, eps: float, norm: bool, own_lm_head: bool) -> None:
        super().__init__()
        if norm:
            self.norm = nn.RMSNorm(dim, eps=eps)
        if own_lm_head:
            self.head = nn.Linear(dim, vocab, bias=False)


class MTPHead(MTPHeadBase):
    FAMILY: ClassVar[str] = "bailing_moe_v3"
    CHAIN_POST_NORM: ClassVar[bool] = True
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    HAS_OWN_LM_HEAD: ClassVar[bool] = True  # shared_head.head, when stored
    SHARED_HEAD_NORM: ClassVar[bool] = False  # Ling 2.5 applies deepseek_mtp's shared_head.norm

    def __init__(
        self,
        args: Any,
        embed_tokens: nn.Module,
        lm_head: Callable[[mx.array], mx.array],
        own_lm_head: bool = False,
    ) -> None:
        super().__init__(embed_tokens, lm_head)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.own_lm_head = own_lm_head
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = self._make_block(args)
        self.final_layernorm = nn.RMSNorm(d, eps=eps)
        if own_lm_head or self.SHARED_HEAD_NORM:
            self.shared_head = _SharedHead(d, args.vocab_size, eps, self.SHARED_HEAD_NORM, own_lm_head)

    @staticmethod
    def _make_block(args: Any) -> nn.Module:
        # index num_hidden_layers: mlx-lm then builds latent attention and MoE, as the head has
        return bailing_moe_v3.BailingDecoderLayer(args, args.num_hidden_layers)

    def _run_block(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        return self.block(x, mask, cache)

    def trunk(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list[Any] | None = None,
        mask: Any = None,
    ) -> mx.array:
        e = self.enorm(self.embed(next_tokens))
        h = self.hnorm(hidden)
        x = self.eh_proj(mx.concatenate([e, h], axis=-1))
        c = self._first(cache)
        if mask is None:
            mask = create_attention_mask(x, c, return_array=True)  # MLA wants an array (or None)
        return self.final_layernorm(self._run_block(x, mask, c))  # post-norm: chained as is

    def logits(self, head_hidden: mx.array) -> mx.array:
        x = self.shared_head.norm(head_hidden) if self.SHARED_HEAD_NORM else head_hidden
        return self.shared_head.head(x) if self.own_lm_head else self.main_lm_head(x)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    if not key.startswith("model.layers."):
        return False
    idx = key.split(".", 3)[2]
    return idx.isdigit() and int(idx) >= int(config["num_hidden_layers"])


def layer_tensors(raw: dict[str, mx.array], config: dict[str, Any], layer: int) -> dict[str, mx.array]:
    """Raw tensors of head layer ``layer`` under head names (own names kept, the decoder
    layer's under ``block.``), copies of the shared embedding dropped."""
    prefix = f"model.layers.{int(config['num_hidden_layers']) + layer}."
    out: dict[str, mx.array] = {}
    for key, value in raw.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if any(d in name for d in _DROP):
            continue
        name = name.replace("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias")
        out[name if name.startswith(_OWN) else f"block.{name}"] = value
    return out


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names (experts
    stacked and ``kv_b_proj`` split, as mlx-lm's ``sanitize`` does for the main layers)."""
    w = layer_tensors(raw, config, layer)
    deepseek_v3.stack_experts(w, int(config.get("num_experts") or 0))
    deepseek_v3.split_kv_b(w, config, attention="attention")
    return w
