"""The n-gram token context of LongCat-Flash n-gram captured inside the verify.

Rules of this module:
- Same contract as melix_mlx.runtime.capture (whose registry, `CAPTURING`, lists the
  class here): the capturing embedding is a subclass of mlx-lm's `NgramEmbedding`,
  installed on the loaded model's instance, adding no parameters. Its cache is the model's
  first leaf, an `ArraysCache(size=1)` whose one array is the token context: the last
  n - 1 token ids fed (n = ``emb_neighbor_num``), int64, one row per sequence.
- The context is a pure function of the tokens fed, so rollback needs no replay: armed
  (its leaf carries the steps list), the embedding records the context after every
  verified position (the n - 1 ids ending there) and `capture.select` keeps each row's
  context at its accepted length.
- One shape for every row and every position: the stored context is always n - 1 ids,
  left-filled with id 0 where fewer tokens were fed. This is exactly mlx-lm's arithmetic:
  its `_shift_right` fills a missing earlier token with 0, so an id 0 in front of the
  context and no token there give the same n-gram ids, hence the same embedding bit for
  bit (tests/adapters/test_family_longcat_ngram.py checks it against mlx-lm's own class on
  prompts shorter and longer than n - 1). A fixed shape is what lets a short row merge,
  extend and filter with the others (mlx-lm's `ArraysCache.merge` copies rows of one shape)
  and lets `select` pick per row with `mx.where`.
- A joint prefill of right-padded prompts (mlx-lm's `prepare(lengths=...)`,
  melix_mlx.runtime.prefill.prefill_together) keeps, per row, the n - 1 ids ending at the
  row's last real token, never the padding after it (mlx-lm's own class keeps the padded
  tail); the embedding advances the leaf's lengths itself, since no other layer reads that
  leaf. The embeddings of the real positions do not depend on later tokens, so they are
  mlx-lm's. A cache prepared with lengths is never armed: meeting one is a `ValueError`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import longcat_flash_ngram

from .cache_leaves import ARMED


def _context(prev: mx.array | None, rows: int, width: int) -> mx.array:
    """`prev` as exactly `width` int64 ids per row, left-filled with 0 (see the rules)."""
    if prev is None:
        return mx.zeros((rows, width), dtype=mx.int64)
    prev = prev.astype(mx.int64)
    if prev.shape[-1] < width:
        fill = mx.zeros((prev.shape[0], width - prev.shape[-1]), dtype=mx.int64)
        prev = mx.concatenate([fill, prev], axis=-1)
    return prev[..., prev.shape[-1] - width :]


class CapturingNgramEmbedding(longcat_flash_ngram.NgramEmbedding):
    """mlx-lm's n-gram embedding that keeps a fixed-width context and records it per position when armed."""

    def __call__(self, input_ids: mx.array, cache: Any = None) -> mx.array:
        width = self.n - 1
        if cache is None or width < 1:
            return super().__call__(input_ids, cache)
        steps = getattr(cache, ARMED, None)
        lengths = cache.lengths
        if steps is not None and lengths is not None:
            raise ValueError("an n-gram context prepared with right-padding lengths cannot be armed")
        rows, fed = input_ids.shape
        prev = _context(cache[0], rows, width)
        cache[0] = prev
        out = super().__call__(input_ids, cache)  # mlx-lm's: context = prev + ids, keeps the last n - 1
        every = mx.concatenate([prev, input_ids.astype(mx.int64)], axis=-1)  # [B, n - 1 + S]
        if lengths is not None:  # each row's n - 1 ids ending at its last real token
            real = mx.clip(lengths, 0, fed).astype(mx.int32)
            at = real[:, None] + mx.arange(width, dtype=mx.int32)[None]
            cache[0] = mx.take_along_axis(every, at, axis=-1)
            cache.advance(fed)
        if steps is not None:
            for t in range(fed):  # the context after position t: ids t + 1 .. t + n - 1 of `every`
                steps.append((every[:, t + 1 : t + 1 + width],))
        return out


CAPTURING: dict[type, type] = {longcat_flash_ngram.NgramEmbedding: CapturingNgramEmbedding}
