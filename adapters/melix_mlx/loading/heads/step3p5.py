"""Step-3.5 MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> sliding-window dense
decoder layer -> ``shared_head.norm`` -> ``shared_head`` output projection.

Rules (facts from the published reference, vLLM's step3p5_mtp and step3p5):
- Raw keys: ``model.layers.{num_hidden_layers + j}.*`` (mlx-lm's ``sanitize`` drops
  every layer at or past ``num_hidden_layers``, and any ``.mtp`` key): ``enorm``,
  ``hnorm``, ``eh_proj`` [D, 2D], ``shared_head.norm``, ``shared_head.output`` (the
  head's own [V, D] projection), and the decoder layer (``self_attn.*`` with ``g_proj``
  and q/k norms, ``input_layernorm``, ``post_attention_layernorm``, a dense ``mlp``),
  possibly under a ``transformer.`` infix that is dropped. A per-layer
  ``embed_tokens`` copy is not loaded: the main embedding is shared.
- Every norm is zero-centred: HF stores w, the model computes with 1 + w (vLLM's
  GemmaRMSNorm; mlx-lm adds 1 in ``sanitize``): ``from_hf`` adds 1 exactly once.
- Concatenation is embedding first. The layer is the decoder layer of index
  ``num_hidden_layers + j``: its config entries (``layer_types``, ``rope_theta``,
  ``partial_rotary_factors``, ``swiglu_limits_shared``) are sized over the decoder plus
  the MTP layers, released as sliding-window attention with a dense MLP (mlx-lm's
  ``Step3p5DecoderLayer`` at that index; a multi-layer checkpoint builds each of its
  layers at the first MTP index). A sliding head layer's cache is a window that evicts
  nothing (melix_mlx.runtime.window_kv ``unevicted``).
- The head reads the main model's PRE-norm hidden (its forward returns the last layer's
  output; the final norm is applied with the lm_head), and chains its own pre-norm layer
  output, normalised by ``shared_head.norm`` only for logits. The engine hands heads the
  main model's post-norm hidden H = rms(x) * w_f, so this head works in that form:
  ``hnorm(x)`` = rms(x) * w_h = H * (w_h / w_f) exactly (the same eps), it returns the
  layer output o as rms(o) * w_f (what chains) and its logits normalise that with
  w_sh / w_f. w_f is the main model's final norm, held by reference; an exact zero in it
  would lose that coordinate (no released checkpoint has one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.step3p5 import Step3p5DecoderLayer, ZeroCenteredRMSNorm

from . import mapping
from .trunk import FusedTrunkHead

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_DROP = ("embed_tokens.", mapping.ROPE_TABLE)
# mlx-lm's sanitize names for the packed MoE form, should a config make the layer sparse
_REMAP = (
    ("moe.gate_proj.", "mlp.switch_mlp.gate_proj."),
    ("moe.up_proj.", "mlp.switch_mlp.up_proj."),
    ("moe.down_proj.", "mlp.switch_mlp.down_proj."),
    ("moe.gate.", "mlp.gate.gate."),
    ("moe.router_bias", "mlp.gate.router_bias"),
    ("share_expert.", "mlp.share_expert."),
)


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "step3p5"
    CHAIN_POST_NORM: ClassVar[bool] = False  # the layer output (in the main model's normed form)
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    HAS_OWN_LM_HEAD: ClassVar[bool] = True  # shared_head.output
    SHARED_HEAD_NORM: ClassVar[bool] = True
    NORM: ClassVar[Callable[..., nn.Module]] = ZeroCenteredRMSNorm  # stored w; from_hf adds the 1
    READS_MAIN_NORM: ClassVar[bool] = True  # w_f: the hidden arrives normed by it

    def _make_block(self, args: Any) -> nn.Module:
        return Step3p5DecoderLayer(args, args.num_hidden_layers)

    def _window(self, args: Any) -> int | None:
        return args.sliding_window if self.block.is_sliding else None

    def _norm_hidden(self, hidden: mx.array) -> mx.array:
        return hidden * (self.hnorm.weight / self._main.norm.weight)  # hnorm of the pre-norm hidden

    def _finish(self, out: mx.array) -> mx.array:
        return mx.fast.rms_norm(out, self._main.norm.weight, self.hnorm.eps)  # the main model's form

    def logits(self, head_hidden: mx.array) -> mx.array:
        normed = head_hidden * (self.shared_head.norm.weight / self._main.norm.weight)
        return self.shared_head.head(normed) if self.own_lm_head else self.main_lm_head(normed)


is_head_key = mapping.is_appended_layer_key


def _rename(name: str) -> str:
    name = name.replace("transformer.", "", 1).replace("shared_head.output.", "shared_head.head.")
    return mapping.renamed(name, _REMAP)


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` names, repairing (1+w) norms."""
    prefix = mapping.appended_layer_prefix(config, layer)
    w = mapping.layer_tensors(raw, prefix, _OWN, drop=_DROP, rename=_rename)
    return {k: v + 1.0 if v.ndim == 1 and k.endswith("norm.weight") else v for k, v in w.items()}
