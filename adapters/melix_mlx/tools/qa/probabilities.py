"""The target's own sampling distribution, for the distribution property of `melix-fsm qa`.

Rules of this module:
- `target_probabilities(model, temperature)` returns the kit's batched probability call
  (melix_fsm.testing.distribution): contexts of one length in, for each the distribution
  mlx-lm's sampler draws the next token from at a plain temperature: softmax(logits / T)
  in float32 (the same as softmax(logprobs / T)), computed by one batched forward of the
  same model object with a fresh cache. No filters (top-p, top-k, min-p): the qa command
  samples at a plain temperature.
- Only mlx and mlx-lm's cache module are imported (no melix_mlx.runtime.sampling, which needs
  mlx-lm 0.32): the distribution property runs under mlx-lm 0.31 too.
- Contexts are answered in chunks (`chunk` rows per forward) so a position with
  thousands of distinct prefixes does not build one huge batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def target_probabilities(model: Any, temperature: float, *, chunk: int = 256) -> Any:
    scale = 1.0 / float(temperature)

    def probs_of(contexts: list[tuple[int, ...]]) -> Sequence[Sequence[float]]:
        out: list[list[float]] = []
        for start in range(0, len(contexts), chunk):
            rows = contexts[start : start + chunk]
            if len({len(r) for r in rows}) != 1:
                raise ValueError("target_probabilities answers contexts of one length at a time")
            cache = make_prompt_cache(model)
            logits = model(mx.array(rows), cache=cache)[:, -1, :]
            logits = logits.astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # as mlx-lm samples
            probs = mx.softmax(logprobs * scale, axis=-1)
            out.extend(probs.tolist())
        return out

    return probs_of
