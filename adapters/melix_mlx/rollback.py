"""Exact cache rollback after a verify forward (single-sequence caches).

Rules of this module:
- A `Checkpoint` is taken right before a verify forward and records what rollback
  needs: each KV-like cache's offset, and a copy of each recurrent (ArraysCache) cache's
  list of arrays. KV caches write in place, so they are never snapshotted by reference;
  they are trimmed. ArraysCache layers replace their arrays on update, so copying the
  list is cheap and exact (`c.state` would return the live list).
- `rollback(cache, checkpoint, keep)` leaves the cache exactly as if only `keep` of the
  verified tokens had been fed. When every layer is trimmable it trims; when a recurrent
  layer is present it restores the checkpoint and reports that the caller must replay
  the kept tokens (the recurrent state cannot be un-applied).
- Cache kinds that cannot be rolled back exactly (a RotatingKVCache that has wrapped,
  unknown kinds) are reported by `unsupported_kinds` before decoding starts; nothing
  rolls back approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    offsets: list[int | None]  # per leaf: KV offset, or None for recurrent leaves
    arrays: list[list[Any] | None]  # per leaf: copied ArraysCache list, or None


def checkpoint(cache: list[Any]) -> Checkpoint:
    offsets: list[int | None] = []
    arrays: list[list[Any] | None] = []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            offsets.append(None)
            arrays.append(list(c.cache))
        else:
            offsets.append(c.offset)
            arrays.append(None)
    return Checkpoint(offsets, arrays)


def restore(cache: list[Any], cp: Checkpoint) -> None:
    """Put every layer back exactly where the checkpoint was taken."""
    for c, offset, saved in zip(leaves(cache), cp.offsets, cp.arrays):
        if saved is not None:
            c.cache = list(saved)
        else:
            extra = c.offset - offset
            if extra > 0:
                c.trim(extra)


def rollback(cache: list[Any], cp: Checkpoint, fed: int, keep: int) -> bool:
    """Undo the last `fed - keep` of `fed` tokens fed since the checkpoint.

    Returns True when the caller must replay the `keep` kept tokens (recurrent layers
    present: the cache was restored to the checkpoint instead of trimmed).
    """
    if keep == fed:
        return False
    if needs_replay(cache):
        restore(cache, cp)
        return keep > 0
    for c in leaves(cache):
        c.trim(fed - keep)
    return False


def trim_all(cache: list[Any], n: int) -> None:
    """Trim n tokens from every (trimmable) layer, e.g. a head's own KV cache."""
    if n <= 0:
        return
    for c in leaves(cache):
        c.trim(n)
