"""Prompt prefill that keeps the main model's hidden states (to prime an MTP head).

Rules of this module:
- Chunking matches mlx-lm's `generate_step`: every prompt token but the last is fed in
  chunks of `step_size`, then the last token alone, so the first generated token's
  logits come from the same forward shapes mlx-lm uses.
- It returns the raw logits of the last prompt position and the post-norm hidden state
  of every prompt position; logits of earlier positions are never computed (mlx is
  lazy and nothing evaluates them).
- `prefill_together` feeds several prompts into one batch cache as mlx-lm's
  `PromptProcessingBatch` does: all tokens but the last right-padded to the longest, the
  padding masked (`prepare(lengths=, right_padding=)`) and moved to the left afterwards
  (`finalize`), then the last tokens as one [B, 1] step, the shape of the first decode
  step of mlx-lm's `BatchGenerator`. One forward per chunk instead of one per prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..loading.errors import InvalidPrompt
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


def prefill_together(
    model: nn.Module, prompts: list[list[int]], cache: list[Any], step_size: int = 2048
) -> tuple[mx.array, list[mx.array]]:
    """Feed `prompts` into `cache`, a batch cache of B empty rows (mlx-lm's `_merge_caches`
    of fresh caches); return (last logits [B, V], each prompt's hiddens [n_i, D])."""
    if not prompts or not all(prompts):
        raise ValueError("prefill_together needs at least one prompt, none empty")
    lengths = [len(p) - 1 for p in prompts]  # every token but the last
    longest = max(lengths)
    chunks: list[mx.array] = []
    if longest:
        padding = [longest - n for n in lengths]
        rest = mx.array([p[:-1] + [0] * pad for p, pad in zip(prompts, padding)])
        if max(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        while rest.shape[1]:
            n = min(step_size, rest.shape[1])
            _, h = forward_with_hidden(model, rest[:, :n], cache)
            mx.eval(h, [c.state for c in cache])
            chunks.append(h)
            rest = rest[:, n:]
        if max(padding):
            for c in cache:
                c.finalize()
    logits, last = forward_with_hidden(model, mx.array([p[-1:] for p in prompts]), cache)
    fed = mx.concatenate(chunks, axis=1) if chunks else None
    hiddens = [
        last[i] if fed is None else mx.concatenate([fed[i, :n], last[i]], axis=0)
        for i, n in enumerate(lengths)
    ]
    return logits[:, -1], hiddens
