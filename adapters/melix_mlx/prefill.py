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

from .hidden import forward_with_hidden


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
