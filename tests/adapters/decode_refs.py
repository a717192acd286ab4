"""Reference runs shared by the single-sequence decode tests.

Rules:
- `reference` is mlx-lm's own `generate_step` on the same loaded model: the ground truth
  every MTP run is compared with, token for token.
- Helpers never cache results across tests; callers pass fresh processors (mlx-lm's
  logits processors are stateless, but the decoder's are not shared by design).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from melix_mlx.decode import MTPDecoder
from mlx_lm.generate import generate_step


def reference(model: Any, prompt: list[int], n: int, **kw: Any) -> list[int]:
    """mlx-lm's greedy (or given-sampler) tokens for `prompt`."""
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kw)]


def mtp(
    model: Any, head: Any, prompt: list[int], n: int, k: int = 1, **kw: Any
) -> tuple[list[int], MTPDecoder]:
    """The decoder's tokens for `prompt`, and the decoder (for its caches and stats)."""
    decoder = MTPDecoder(model, head, num_draft_tokens=k, **kw)
    return [t for t, _, _ in decoder.generate(mx.array(prompt), n)], decoder


def cut_at_stop(tokens: list[int], stop: list[list[int]], eos: set[int]) -> tuple[list[int], str]:
    """`tokens` up to (excluding) the first EOS or completed stop sequence, and the reason."""
    for i, t in enumerate(tokens):
        if t in eos or any(len(s) <= i + 1 and tokens[i + 1 - len(s) : i + 1] == s for s in stop):
            return tokens[:i], "stop"
    return tokens, "length"
