"""Per-row rollback of batched caches, and ragged forwards.

Rules of this module:
- Every row of a batched cache is one sequence; rolling one row back never touches
  another row's entries.
- `BatchKVCache.trim(n)` is uniform across rows. Per-row rollback therefore trims the
  rows' common rejected suffix, then marks each row's remaining rejected entries as
  right padding and lets `finalize()` roll them to the front as masked left padding
  (the mechanism mlx-lm itself uses for right-padded prompts). `filter` later reclaims
  padding common to all rows.
- Recurrent (ArraysCache) rows cannot be trimmed: `rollback_rows` restores them from the
  checkpoint taken before the verify and tells the caller to replay each row's kept
  tokens with `ragged_forward`, which masks every row past its own length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .rollback import leaves


def arrays_checkpoint(cache: list[Any]) -> list[list[Any] | None]:
    """Copies of every recurrent leaf's array list (None for KV leaves)."""
    return [list(c.cache) if isinstance(c, ArraysCache) else None for c in leaves(cache)]


def has_recurrent(cache: list[Any]) -> bool:
    return any(isinstance(c, ArraysCache) for c in leaves(cache))


def drop_row_suffixes(cache: list[Any], drop: list[int]) -> None:
    """Remove the last drop[i] entries of row i from every KV leaf of a batched cache."""
    if not any(drop):
        return
    common = min(drop)
    extra = [d - common for d in drop]
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            raise TypeError("recurrent layers cannot drop entries; restore and replay instead")
        if common:
            c.trim(common)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()


def rollback_rows(cache: list[Any], checkpoint: list[list[Any] | None], fed: int, keep: list[int]) -> bool:
    """Keep the first keep[i] of the `fed` tokens each row was fed since `checkpoint`.

    Returns True when the caller must replay every row's kept tokens (the cache has
    recurrent layers, which were restored to the checkpoint and had all KV entries of
    this forward trimmed).
    """
    if all(k == fed for k in keep):
        return False
    if not has_recurrent(cache):
        drop_row_suffixes(cache, [fed - k for k in keep])
        return False
    for c, saved in zip(leaves(cache), checkpoint):
        if saved is not None:
            c.cache = list(saved)
        else:
            c.trim(fed)
    return True


def ragged_forward(
    forward: Callable[[mx.array, list[Any]], tuple[mx.array, mx.array]],
    rows: list[list[int]],
    cache: list[Any],
) -> tuple[mx.array, mx.array]:
    """Feed row i the tokens rows[i] (ragged, right-padded) and keep only those entries."""
    lengths = [len(r) for r in rows]
    width = max(lengths)
    padding = [width - n for n in lengths]
    inputs = mx.array([r + [0] * p for r, p in zip(rows, padding)])
    if any(padding):
        for c in leaves(cache):
            c.prepare(lengths=lengths, right_padding=padding)
    out = forward(inputs, cache)
    if any(padding):
        for c in leaves(cache):
            c.finalize()
    return out
