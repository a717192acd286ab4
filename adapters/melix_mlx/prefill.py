"""Prompt prefill that keeps the main model's hidden states (to prime an MTP head).

Rules of this module:
- Chunking matches mlx-lm's `generate_step`: every prompt token but the last is fed in
  chunks of `step_size`, then the last token alone, so the first generated token's
  logits come from the same forward shapes mlx-lm uses.
- It returns the raw logits of the last prompt position and the post-norm hidden state
  of every prompt position; logits of earlier positions are never computed (mlx is
  lazy and nothing evaluates them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import InvalidPrompt
from .hidden import forward_with_hidden, main_parts


def vocabulary_size(model: nn.Module) -> int | None:
    """Rows of the main model's embedding table (None where it cannot be read)."""
    embed = main_parts(model).embed_tokens
    size = getattr(embed, "num_embeddings", None)  # QuantizedEmbedding
    if size is None and getattr(embed, "weight", None) is not None:
        size = embed.weight.shape[0]
    return int(size) if size is not None else None


def check_prompt(model: nn.Module, tokens: list[int], what: str = "the prompt") -> None:
    """Refuse an empty prompt or one with ids outside the vocabulary (InvalidPrompt)."""
    if not tokens:
        raise InvalidPrompt(f"{what} is empty")
    vocab = vocabulary_size(model)
    bad = [t for t in tokens if not 0 <= t < (vocab if vocab is not None else t + 1)]
    if bad:
        raise InvalidPrompt(
            f"{what} has token ids outside the model's vocabulary of {vocab}: {sorted(set(bad))[:8]}"
        )


def prefill_with_hidden(
    model: nn.Module,
    prompt: mx.array,
    cache: list[Any],
    step_size: int = 2048,
    after_chunk: Callable[[], None] | None = None,
) -> tuple[mx.array, mx.array]:
    """Feed `prompt` [n] into `cache`; return (last logits [1, V], hiddens [n, D]).

    `after_chunk` runs after each chunk but the last token's forward, where mlx-lm's
    `generate_step` converts its KV cache to quantized form.
    """
    if prompt.size == 0:
        raise ValueError("the prompt is empty")
    hiddens = []
    rest = prompt
    while rest.size > 1:
        n = min(step_size, rest.size - 1)
        _, h = forward_with_hidden(model, rest[:n][None], cache)
        if after_chunk is not None:
            after_chunk()
        mx.eval(h, [c.state for c in cache])
        hiddens.append(h[0])
        rest = rest[n:]
    logits, h = forward_with_hidden(model, rest[None], cache)
    hiddens.append(h[0])
    return logits[0, -1:], mx.concatenate(hiddens, axis=0)
