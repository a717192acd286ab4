"""Sliding-window (rotating) KV layers with exact rollback: the window kept in the mask.

Rules of this module:
- mlx-lm's `RotatingKVCache(max_size=M, keep=K)` decodes one token at position p over
  exactly the first K positions and the last M - K positions up to p (it overwrites the
  oldest entry in place). It trims exactly only until it wraps, so a verify (several
  positions written at once, then some rejected) cannot be undone in it.
- `WindowedKVCache` reproduces that attention set for every query of a verify through an
  explicit mask, and keeps its entries in temporal order with spare slots: an entry is
  evicted only once no position at or after the cache's confirmed offset can attend to
  it, so the entries a rollback exposes again are still there. `trim(n)` is then exact.
  During a cycle it holds M - 1 + (k + 1) entries: k spare slots.
- The prompt is prefilled in mlx-lm's own RotatingKVCache (same chunks, same semantics:
  a multi-token chunk sees mlx-lm's window mask); `adopt` then converts each rotating
  leaf, after the prefill's last (single-token) step, into the windowed form.
- `WindowedKVCache.unevicted(W)` keeps every entry (the window only in the mask): an MTP
  head's own sliding-window attention, whose cache is trimmed by its chained drafts as
  well as by rollbacks (melix_mlx.runtime.engine), so nothing it may expose again is ever
  evicted. Like a head's plain KVCache it holds the whole context.
- `merge` builds the batch form (melix_mlx.runtime.window_batch.RaggedWindowKVCache) from
  rows without a kept prefix (a head's windows, a caller's windows); a kept prefix
  (`keep` > 0, mlx-lm's max_kv_size) has no batch form (spec/rollback.toml). A head's
  window handed back from a batch form (mlx-lm's RotatingKVCache) becomes an unevicted
  window again (`single_head`).
- Quantizing a window is refused, as mlx-lm refuses it (`to_quantized` raises
  NotImplementedError).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache


class WindowedKVCache(KVCache):
    """Keys/values of positions [0, keep) and [start, offset), masked as mlx-lm decodes."""

    def __init__(self, max_size: int, keep: int) -> None:
        super().__init__()
        self.max_size, self.keep = max_size, keep
        self.start = keep  # absolute position of the first recent entry
        self.evicts = True

    @classmethod
    def unevicted(cls, max_size: int) -> WindowedKVCache:
        """A window that keeps every entry (an MTP head's windowed attention)."""
        out = cls(max_size, 0)
        out.evicts = False
        return out

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        """The batch form of window rows (mlx-lm's merge protocol)."""
        from .window_batch import RaggedWindowKVCache

        if any(c.keep for c in caches):
            raise ValueError("a window with a kept prefix (keep > 0) has no batch form")
        rows = [(c.keys, c.values, c.offset) for c in caches]
        return RaggedWindowKVCache.from_rows(caches[0].max_size, rows)

    @classmethod
    def from_rotating(cls, rc: RotatingKVCache) -> WindowedKVCache:
        out = cls(rc.max_size, rc.keep)
        out.offset = rc.offset
        if rc.keys is None:
            return out
        keys, values = rc._temporal_order(rc.keys), rc._temporal_order(rc.values)
        length = min(rc.offset, rc.max_size)
        out.keys, out.values = keys[..., :length, :], values[..., :length, :]
        out.start = max(rc.keep, rc.offset - (rc.max_size - rc.keep))
        return out

    # -- layout ------------------------------------------------------------------------
    def _kept(self) -> int:
        return min(self.keep, self.offset)

    def _evict_to(self) -> int:
        """The first recent position any query at or after `offset` can still attend to."""
        if not self.evicts:
            return self.start
        return max(self.start, self.offset - (self.max_size - self.keep) + 1)

    def _positions(self, start: int, n_new: int) -> mx.array:
        kept = mx.arange(self._kept())
        return mx.concatenate([kept, mx.arange(start, self.offset + n_new)])

    # -- cache protocol ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        evict_to = self._evict_to()
        if self.keys is not None and evict_to > self.start:
            kept, cut = self._kept(), evict_to - self.start

            def drop(x: mx.array) -> mx.array:
                return mx.concatenate([x[..., :kept, :], x[..., kept + cut :, :]], axis=2)

            self.keys, self.values = drop(self.keys), drop(self.values)
        self.start = evict_to
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        """[N, entries after the update]: position p sees [0, keep) and (p - (M - keep), p]."""
        span = self.max_size - self.keep
        if window_size is not None:
            span = min(span, window_size)
        entries = self._positions(self._evict_to(), N)[None]
        queries = mx.arange(self.offset, self.offset + N)[:, None]
        recent = entries > queries - span
        return (entries <= queries) & ((entries < self.keep) | recent)

    def trim(self, n: int) -> int:
        n = min(n, self.offset - self.start)  # the spare slots cover every rollback
        if n > 0 and self.keys is not None:
            self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]
        self.offset -= max(n, 0)
        return max(n, 0)

    def is_trimmable(self) -> bool:
        return True

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        raise NotImplementedError("RotatingKVCache Quantization NYI")  # mlx-lm's own refusal

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset, self.start

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.offset, self.start = v


def single_head(c: Any) -> Any:
    """A head's cache handed back from a batch form: its window (mlx-lm's RotatingKVCache)
    becomes a window that evicts nothing again; anything else is returned as is."""
    if not isinstance(c, RotatingKVCache):
        return c
    out = WindowedKVCache.from_rotating(c)
    out.evicts = False
    return out


def adopt(cache: list[Any]) -> list[Any]:
    """Replace every RotatingKVCache leaf (in place) by its windowed form."""
    for i, c in enumerate(cache):
        if isinstance(c, RotatingKVCache):
            cache[i] = WindowedKVCache.from_rotating(c)
        elif isinstance(c, CacheList):
            adopt(c.caches)
    return cache
