"""The prompt cache as mlx-lm's plain (single-sequence) path needs it.

Rules: mlx-lm's `_serve_single` fails on a prompt its cache holds entirely (nothing is
left to prefill). The batched path gives the last token back (melix_mlx.decoding.batch_surface);
`PartialHits` does the same for the plain path: the (deep-copied) cache is trimmed by
one token, or not used when it cannot be trimmed. Everything else is the shared cache.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


class PartialHits:
    """The prompt cache as mlx-lm's plain path needs it: a hit leaves a token to feed.

    mlx-lm's `_serve_single` fails on a prompt its cache holds entirely (nothing left to
    prefill); the batched path gives the last token back (melix_mlx.decoding.batch_surface), and
    so does this view: the (deep-copied) cache is trimmed by one, or not used."""

    def __init__(self, shared: Any) -> None:
        self.shared = shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shared, name)

    def __len__(self) -> int:
        return len(self.shared)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = self.shared.fetch_nearest_cache(model, tokens)
        if cache is None or len(rest) or not tokens:
            return cache, rest
        if not can_trim_prompt_cache(cache):
            return None, tokens
        trim_prompt_cache(cache, 1)
        return cache, tokens[-1:]
