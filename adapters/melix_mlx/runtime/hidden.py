"""Main-model access without patching mlx-lm: final hidden states, embedding, lm_head.

Rules:
- ``forward_with_hidden`` runs the model's own inner module (``model.model`` for
  deepseek_v3/mimo, ``model.language_model.model`` for qwen3_5, ``model.backbone`` for
  nemotron_h) and applies the output
  projection exactly as the model's ``__call__`` does, so its logits are bitwise equal
  to ``model(inputs, cache)``. ``hidden`` is the final POST-norm state (lm_head input).
- Nothing here mutates the model or mlx-lm; it only reads attributes.
"""

from __future__ import annotations

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
    if embed_name is None:
        raise UnsupportedModel(
            f"{type(model).__module__}.{type(model).__name__} has no inner model with "
            "an embedding; cannot read its hidden states"
        )
    args = getattr(text, "args", None)
    embed = inner[embed_name]
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
    return MainParts(text=text, inner=inner, args=args, embed_tokens=embed, lm_head=lm_head)


def forward_with_hidden(
    model: nn.Module, inputs: mx.array, cache: list | None = None, **kw: Any
) -> tuple[mx.array, mx.array]:
    """Return ``(logits [B, L, V], hidden [B, L, D])`` for ``inputs [B, L]``.

    ``cache`` is the model's own cache list (``make_prompt_cache(model)``); extra keyword
    arguments (e.g. ``input_embeddings`` for qwen3_5) go to the inner model.
    """
    parts = main_parts(model)
    hidden = parts.inner(inputs, cache, **kw)
    return parts.lm_head(hidden), hidden
