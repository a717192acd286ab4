"""Main-model access without patching mlx-lm: final hidden states, embedding, lm_head.

Rules:
- ``forward_with_hidden`` runs the model's own inner module (``model.model`` for
  deepseek_v3/mimo, ``model.language_model.model`` for qwen3_5, ``model.backbone`` for
  nemotron_h) and applies the output
  projection exactly as the model's ``__call__`` does, so its logits are bitwise equal
  to ``model(inputs, cache)``. ``hidden`` is the final POST-norm state (lm_head input).
- Nothing here mutates the model or mlx-lm; it only reads attributes (a tapped forward
  swaps a recorder into the layer list for the call's duration and puts the layer back).
- Hidden taps: a head that reads intermediate trunk layers (deepseek_v41's DSpark drafter
  reads the hyper-connection streams ENTERING its target layers, averaged over the
  streams) declares their ids with ``declare_taps(model, ids)``. From then on
  ``forward_with_hidden`` returns ``[final | tap_0 | tap_1 ...]`` on the last axis: the
  first D features are still the lm_head input (``main_parts(model).lm_head`` reads only
  those), the rest the taps in ascending layer order. Undeclared models are unchanged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..loading.errors import UnsupportedModel


@dataclass(frozen=True)
class MainParts:
    """Pieces of a loaded mlx-lm model that an MTP head shares or needs."""

    text: nn.Module  # the module whose __call__ is inner model + lm_head
    inner: nn.Module  # embed_tokens, layers, final norm; returns post-norm hidden
    args: Any  # the language-model ModelArgs (TextModelArgs for qwen3_5)
    embed_tokens: nn.Module
    lm_head: Callable[[mx.array], mx.array]


# mlx-lm's names for the inner model and its embedding (nemotron_h: backbone.embeddings,
# the bailing families: model.word_embeddings)
_INNER = ("model", "backbone")
_EMBED = ("embed_tokens", "embeddings", "word_embeddings")


def main_parts(model: nn.Module) -> MainParts:
    """Locate text module, inner model, embedding and lm_head of a loaded model."""
    text = model.get("language_model", model)
    inner = next((text[n] for n in _INNER if isinstance(text, dict) and n in text), None)
    embed_name = next((n for n in _EMBED if inner is not None and n in inner), None)
    holder = inner
    if embed_name is None and inner is not None and "ngram_embeddings" in inner:
        holder, embed_name = inner["ngram_embeddings"], "word_embeddings"  # longcat_flash_ngram's word table
    if embed_name is None:
        raise UnsupportedModel(
            f"{type(model).__module__}.{type(model).__name__} has no inner model with "
            "an embedding; cannot read its hidden states"
        )
    args = getattr(text, "args", None)
    embed = holder[embed_name]
    if getattr(args, "tie_word_embeddings", False) or "lm_head" not in text:
        lm_head: Callable[[mx.array], mx.array] = embed.as_linear
    else:
        head_module = text.lm_head
        group = getattr(text, "sharding_group", None)
        if group is not None:  # qwen3_5 vocab-sharded lm_head: gather like __call__ does
            from mlx_lm.models.base import gather_last_axis

            def lm_head(h: mx.array) -> mx.array:
                return gather_last_axis(head_module(h), group)
        else:
            lm_head = head_module
    if taps_of(model) is not None:  # [final | taps]: the lm_head reads the final part only
        lm_head = _final_part(lm_head, int(args.hidden_size))
    return MainParts(text=text, inner=inner, args=args, embed_tokens=embed, lm_head=lm_head)


def _final_part(lm_head: Callable[[mx.array], mx.array], dim: int) -> Callable[[mx.array], mx.array]:
    def head(h: mx.array) -> mx.array:
        return lm_head(h[..., :dim])

    return head


# id(model) -> (weak reference, tapped layer ids); nn.Module is a dict, so not hashable
_TAPS: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}


def declare_taps(model: nn.Module, layer_ids: tuple[int, ...] | list[int]) -> None:
    """From now on `forward_with_hidden(model, ...)` also returns the (stream-averaged)
    inputs of layers `layer_ids`; see the module rules."""
    ids = tuple(sorted(int(i) for i in layer_ids))
    layers = main_parts(model).inner.layers
    if not ids or ids[0] < 0 or ids[-1] >= len(layers) or len(set(ids)) != len(ids):
        raise UnsupportedModel(f"hidden taps {list(layer_ids)} are not distinct layers of {len(layers)}")
    key = id(model)
    _TAPS[key] = (weakref.ref(model, lambda _: _TAPS.pop(key, None)), ids)


def taps_of(model: nn.Module) -> tuple[int, ...] | None:
    """The layer ids declared for `model`, or None."""
    found = _TAPS.get(id(model))
    return found[1] if found is not None and found[0]() is model else None


class _Recorder:
    """Stands in for one layer during a tapped forward: records its first argument (the
    hidden or hyper-connection streams entering it), then runs the layer."""

    def __init__(self, layer: Any, sink: list[mx.array]) -> None:
        self._layer, self._sink = layer, sink

    def __call__(self, x: mx.array, *args: Any, **kw: Any) -> Any:
        # streams [B, L, n, D] are averaged over the n streams; a plain hidden is kept
        self._sink.append(mx.mean(x, axis=2) if x.ndim == 4 else x)
        return self._layer(x, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _tapped(inner: nn.Module, ids: tuple[int, ...], inputs: mx.array, cache: Any, **kw: Any) -> mx.array:
    layers = inner.layers
    sinks: list[list[mx.array]] = [[] for _ in ids]
    originals = [layers[i] for i in ids]
    try:
        for i, sink in zip(ids, sinks, strict=True):
            layers[i] = _Recorder(layers[i], sink)
        hidden = inner(inputs, cache, **kw)
    finally:
        for i, layer in zip(ids, originals, strict=True):
            layers[i] = layer
    if any(len(sink) != 1 for sink in sinks):
        raise UnsupportedModel(f"hidden taps {list(ids)}: not every tapped layer ran once in this forward")
    return mx.concatenate([hidden, *(sink[0] for sink in sinks)], axis=-1)


def forward_with_hidden(
    model: nn.Module, inputs: mx.array, cache: list | None = None, **kw: Any
) -> tuple[mx.array, mx.array]:
    """Return ``(logits [B, L, V], hidden [B, L, D])`` for ``inputs [B, L]`` (hidden
    ``[B, L, D * (1 + taps)]`` for a model with declared taps).

    ``cache`` is the model's own cache list (``make_prompt_cache(model)``); extra keyword
    arguments (e.g. ``input_embeddings`` for qwen3_5) go to the inner model.
    """
    parts = main_parts(model)
    ids = taps_of(model)
    if ids is not None:  # [final | taps]; parts.lm_head reads the final part
        hidden = _tapped(parts.inner, ids, inputs, cache, **kw)
        return parts.lm_head(hidden), hidden
    hidden = parts.inner(inputs, cache, **kw)
    return parts.lm_head(hidden), hidden
