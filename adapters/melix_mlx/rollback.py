"""Exact cache rollback after a verify forward, per row, for single and batched caches.

Rules of this module:
- Every row of a batched cache is one sequence; rolling one row back never touches
  another row's entries. A single-sequence cache is the one-row case.
- KV-like leaves are trimmed. A batch cache's `trim(n)` is uniform across rows, so
  `drop_row_suffixes` trims the rows' common rejected suffix and leaves each row's
  remaining rejected entries to the cache: melix_mlx.ragged_kv masks them as holes
  without moving data; a plain `BatchKVCache` (a caller's own) gets them as right
  padding rolled to the front by `finalize()`, mlx-lm's own mechanism. KV caches write
  in place, so they are never snapshotted by reference.
- Recurrent (ArraysCache) leaves are not trimmable. The verify captures their state at
  every position and rollback selects it (melix_mlx.capture). Where a layer cannot be
  captured, a `Checkpoint` (a copy of each leaf's array list: the layer replaces its
  arrays on update, so the copy is cheap and exact) is restored and the kept tokens are
  replayed with `ragged_forward`, which masks every row past its own length.
- Cache kinds that cannot be rolled back exactly (a RotatingKVCache, which is exact only
  until it wraps; unknown kinds) are reported by `unsupported_kinds` before decoding
  starts; nothing rolls back approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

_TRIMMABLE_KV = (KVCache, QuantizedKVCache)


def leaves(cache: list[Any]) -> list[Any]:
    """Flatten CacheList containers into their layer caches."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(leaves(list(c.caches)))
        else:
            out.append(c)
    return out


def kind_of(c: Any) -> str:
    """The registry's name for a cache's kind."""
    if isinstance(c, QuantizedKVCache):
        return "quantized_kv"
    if isinstance(c, KVCache):
        return "kv"
    if isinstance(c, RotatingKVCache):
        return "rotating"
    if isinstance(c, ArraysCache):
        return "arrays"
    return type(c).__name__


def cache_kinds(cache: list[Any]) -> list[str]:
    return sorted({kind_of(c) for c in leaves(cache)})


def unsupported_kinds(cache: list[Any]) -> list[str]:
    """Kinds this module cannot roll back exactly (empty when all are supported)."""
    bad = set()
    for c in leaves(cache):
        if isinstance(c, _TRIMMABLE_KV + (ArraysCache,)):
            continue
        # A rotating cache trims exactly only until it wraps; speculation near the
        # window edge would corrupt it, so it is refused rather than trusted.
        bad.add(kind_of(c))
    return sorted(bad)


def needs_replay(cache: list[Any]) -> bool:
    return any(isinstance(c, ArraysCache) for c in leaves(cache))


@dataclass
class Checkpoint:
    """Where every leaf stood before a forward: KV offsets and recurrent array lists."""

    offsets: list[Any]  # per leaf: KV offset (int, or the per-row array of a batch cache)
    indices: list[int | None]  # per leaf: a batch cache's write index, else None
    arrays: list[list[Any] | None]  # per leaf: copied ArraysCache list, or None


def checkpoint(cache: list[Any]) -> Checkpoint:
    offsets: list[Any] = []
    indices: list[int | None] = []
    arrays: list[list[Any] | None] = []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            offsets.append(None)
            indices.append(None)
            arrays.append(list(c.cache))
        else:
            offsets.append(c.offset)
            indices.append(getattr(c, "_idx", None))
            arrays.append(None)
    return Checkpoint(offsets, indices, arrays)


def restore(cache: list[Any], cp: Checkpoint) -> None:
    """Put every layer back exactly where the checkpoint was taken."""
    for c, offset, index, saved in zip(leaves(cache), cp.offsets, cp.indices, cp.arrays):
        if saved is not None:
            c.cache = list(saved)
        elif index is not None:
            extra = c._idx - index
            if extra > 0:
                c.trim(extra)
        else:
            extra = c.offset - offset
            if extra > 0:
                c.trim(extra)


def drop_row_suffixes(cache: list[Any], drop: list[int], *, skip_recurrent: bool = False) -> None:
    """Remove the last drop[i] entries of row i from every KV leaf.

    Recurrent leaves cannot drop entries: they raise, unless `skip_recurrent` says the
    caller has already set them (captured states).
    """
    if not drop or not any(drop):
        return
    common = min(drop)
    extra = [d - common for d in drop]
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            if skip_recurrent:
                continue
            raise TypeError("recurrent layers cannot drop entries; select captured states instead")
        if hasattr(c, "drop_rows"):  # melix_mlx.ragged_kv: holes, no data moved
            c.drop_rows(drop)
            continue
        if common:
            c.trim(common)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()


def trim_all(cache: list[Any], n: int) -> None:
    """Trim n tokens from every (trimmable) layer, e.g. a head's own KV cache."""
    if n <= 0:
        return
    for c in leaves(cache):
        c.trim(n)


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
