"""A batched KV cache whose rows roll back independently without moving any data.

Rules of this module:
- `RaggedBatchKVCache` is mlx-lm's `BatchKVCache` plus a per-row hole mask. Rolling row
  i back by n entries (`drop_rows`) trims what all rows drop in common from the end and
  marks each row's remaining rejected entries as holes: masked out of attention, their
  positions subtracted from the row's RoPE offset. Nothing is copied, so the cost of a
  rollback does not depend on how the rows' accept lengths differ (mlx-lm's own
  mechanism, right padding rolled to the front, moves every row's whole buffer).
- Holes only ever sit between entries; the next forward writes after them. Masking a
  slot is exactly what left padding already does, so attention over a row with holes
  equals attention over the same entries without them.
- Holes cost memory and attention reads until they are reclaimed: `compact` gathers
  every row's live entries (one copy, amortised) once holes exceed `COMPACT_AT` of the
  buffer; `filter` also reclaims padding common to all rows; `extract` returns only a
  row's live entries.
- Rollback can also run inside the cycle's lazy graph, before its outcome is on the host
  (`drop_rows` with a device array): every rejected entry becomes a hole (no common trim,
  that needs host values), the RoPE offsets move on the device, and the host-side hole
  counts catch up once the outcome is synced (`count_holes`). This is what lets the next
  cycle be built while the current one still runs. Compaction reshapes the buffer on the
  host, so it waits for a moment with no cycle in flight (`compaction_due`).
- `adopt` converts the `BatchKVCache` leaves mlx-lm's `merge` builds; every other kind is
  left alone (melix_mlx.runtime.batch_caches gives a merge's windows their form too).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

COMPACT_AT = 0.25  # reclaim holes once they exceed this share of the written entries
COMPACT_MIN = 64  # ... and at least this many entries in the worst row


class RaggedBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache with per-row holes; see the module rules."""

    holes: mx.array | None = None  # [B, n <= _idx] True where an entry was rolled back
    hole_counts: list[int] | None = None  # per row, on the host (for compaction)
    uncounted: int = 0  # lazy drops whose holes the host has not counted yet

    def _hole_mask(self, length: int) -> mx.array:
        B = self.offset.shape[0]
        if self.holes is None:
            return mx.zeros((B, length), mx.bool_)
        n = self.holes.shape[1]
        if n >= length:
            return self.holes[:, :length]
        return mx.concatenate([self.holes, mx.zeros((B, length - n), mx.bool_)], axis=1)

    def _counts(self) -> list[int]:
        return self.hole_counts if self.hole_counts is not None else [0] * self.offset.shape[0]

    # -- rollback --------------------------------------------------------------------
    def drop_rows(self, drop: list[int] | mx.array) -> None:
        """Roll row i back by drop[i] entries (all among the most recent writes).

        A device array (the cycle's outcome, not yet synced) is applied lazily: every
        dropped entry becomes a hole and the host counts wait for `count_holes`.
        """
        if isinstance(drop, mx.array):
            dropped = mx.arange(self._idx)[None] >= (self._idx - drop)[:, None]
            self.holes = self._hole_mask(self._idx) | dropped
            self.offset = self.offset - drop
            self.uncounted += 1
            return
        common = min(drop)
        if common:
            self.trim(common)
        extra = [d - common for d in drop]
        if not any(extra):
            return
        extra_arr = mx.array(extra)
        positions = mx.arange(self._idx)[None]
        dropped = positions >= (self._idx - extra_arr)[:, None]
        self.holes = self._hole_mask(self._idx) | dropped
        self.hole_counts = [c + e for c, e in zip(self._counts(), extra)]
        self.offset = self.offset - extra_arr
        if self.compaction_due():
            self.compact()

    def count_holes(self, drop: list[int], at_tail: bool = False) -> None:
        """The host's count of the holes a lazy `drop_rows(array)` made, once synced.

        `at_tail`: nothing was written after that rollback, so the holes every row shares
        end the buffer and are trimmed away instead of kept (a single row keeps none).
        """
        self.uncounted -= 1
        common = min(drop, default=0) if at_tail else 0
        if common:
            self._idx -= common  # hole entries: the RoPE offsets already exclude them
            if self.holes is not None:
                self.holes = self.holes[:, : self._idx]
        if any(d - common for d in drop):
            self.hole_counts = [c + d - common for c, d in zip(self._counts(), drop)]
        if not self.uncounted and not any(self._counts()):
            self.holes, self.hole_counts = None, None  # no hole left: no mask to apply

    def _settled(self, operation: str) -> None:
        """Reshaping needs the host counts: never while a lazy rollback is uncounted."""
        if self.uncounted:
            raise RuntimeError(f"{operation} of a ragged cache while a cycle's rollback is in flight")

    def compaction_due(self) -> bool:
        if self.uncounted:
            return False
        worst = max(self._counts(), default=0)
        return worst >= COMPACT_MIN and worst > COMPACT_AT * self._idx

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        if self.holes is not None and self.holes.shape[1] > self._idx - n:
            self._settled("trim over holes")
            # rows lose only the live entries among the trimmed ones
            cut = self.holes[:, self._idx - n :]
            live = n - cut.astype(mx.int32).sum(axis=1)
            cut_counts = cut.astype(mx.int32).sum(axis=1).tolist()
            self.holes = self.holes[:, : self._idx - n]
            self.hole_counts = [c - k for c, k in zip(self._counts(), cut_counts)]
            self._idx -= n
            self.offset = self.offset - live
            return n
        return super().trim(n)

    def compact(self) -> None:
        """Gather every row's live entries, right-aligned; holes become left padding."""
        self._settled("compact")
        if self.holes is None or self.keys is None:
            return
        pad = self.left_padding.tolist()
        holes = self._hole_mask(self._idx).tolist()
        live = [[p for p in range(pad[i], self._idx) if not holes[i][p]] for i in range(len(pad))]
        width = max(len(r) for r in live)
        index = mx.array([[0] * (width - len(r)) + r for r in live])
        gather = index[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys[..., : self._idx, :], gather, axis=2)
        self.values = mx.take_along_axis(self.values[..., : self._idx, :], gather, axis=2)
        self.left_padding = mx.array([width - len(r) for r in live])
        self._idx = width
        self.holes, self.hole_counts = None, None

    # -- attention -------------------------------------------------------------------
    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        if self.holes is None:
            return mask
        live = ~self._hole_mask(self._idx + N)
        return mask & live[:, None, None, :]

    # -- reshaping ---------------------------------------------------------------------
    def filter(self, batch_indices: Any) -> None:
        self._settled("filter")
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        if self.holes is not None:
            self.holes = self.holes[mx.array(rows)]
            self.hole_counts = [self._counts()[i] for i in rows]
        before = self._idx
        super().filter(batch_indices)
        shift = before - self._idx  # padding common to every survivor, reclaimed
        if shift and self.holes is not None:
            self.holes = self.holes[:, shift:]
        if self.hole_counts is not None and not any(self.hole_counts):
            self.holes, self.hole_counts = None, None

    def extend(self, other: BatchKVCache) -> None:
        self._settled("extend")
        mine, theirs = self._idx, other._idx
        holes_a = self._hole_mask(mine) if self.holes is not None else None
        other_holes = getattr(other, "holes", None)
        holes_b = other._hole_mask(theirs) if other_holes is not None else None
        counts = self._counts() + (
            other.hole_counts if getattr(other, "hole_counts", None) else [0] * other.offset.shape[0]
        )
        super().extend(other)
        if holes_a is None and holes_b is None:
            return
        width = self._idx

        def right_aligned(holes: mx.array | None, length: int, rows: int) -> mx.array:
            if holes is None:
                return mx.zeros((rows, width), mx.bool_)
            return mx.concatenate([mx.zeros((rows, width - length), mx.bool_), holes], axis=1)

        rows_a = len(counts) - other.offset.shape[0]
        self.holes = mx.concatenate(
            [right_aligned(holes_a, mine, rows_a), right_aligned(holes_b, theirs, len(counts) - rows_a)]
        )
        self.hole_counts = counts

    def extract(self, idx: int) -> KVCache:
        self._settled("extract")
        if self.holes is None:
            return super().extract(idx)
        pad = self.left_padding.tolist()[idx]
        holes = self._hole_mask(self._idx)[idx].tolist()
        keep = mx.array([p for p in range(pad, self._idx) if not holes[p]])
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, keep])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, keep])
        cache.offset = cache.keys.shape[2]
        return cache


def adopt(cache: list[Any]) -> list[Any]:
    """Turn the plain `BatchKVCache` leaves of a merged cache into ragged ones, in place
    (melix_mlx.runtime.batch_caches.adopt also gives windows their form, first)."""
    from .rollback import leaves

    for c in leaves(cache):
        if type(c) is BatchKVCache:
            c.__class__ = RaggedBatchKVCache
    return cache
