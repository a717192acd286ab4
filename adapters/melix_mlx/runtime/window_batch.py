"""Batched sliding-window (rotating) KV layers with exact per-row rollback.

Rules of this module:
- mlx-lm's batch window cache (`BatchRotatingKVCache`) lets a query at position p of a
  row attend to that row's positions (p - W, p] (W = max_size, nothing kept at the
  front), as its single-sequence `RotatingKVCache(max_size=W)` decodes. It overwrites
  the oldest entries in place, so a verify (several positions written, some rejected)
  cannot be undone in it.
- `RaggedWindowKVCache` is melix_mlx.runtime.ragged_kv's ragged batch cache (per-row
  holes, rollback in the graph, no data moved) with the window applied in each row's
  mask instead of by overwriting: a row's live entries are consecutive positions ending
  at its offset, so an entry's position is the row's offset minus the live entries from
  it to the end, and a query at p sees the live entries in (p - W, p]. The entries a
  rollback exposes again are therefore still there: the k spare slots a verify writes
  past the window are simply kept until the next compaction.
- Eviction happens only in `compact`, at a moment with no step in flight (the engine's
  settle; `compaction_due` keeps the step pipeline from building a step ahead once due):
  each row keeps its last W live entries (a query at or after its offset reaches W - 1 of
  them; W is what mlx-lm's single-sequence cache holds, so `extract` hands a whole window
  back); what no row can reach goes. Between compactions the buffer grows by at most
  `SLACK` columns past the window.
- `from_batch_rotating` converts mlx-lm's freshly merged `BatchRotatingKVCache` (rows in
  temporal order, right-aligned, true offsets); `extract` hands a row back as mlx-lm's
  `RotatingKVCache` with its last W entries. A kept prefix (`keep` > 0, mlx-lm's
  `max_kv_size`) has no batch form in mlx-lm: spec/rollback.toml refuses it batched.
- Quantizing a window is refused, as mlx-lm refuses it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, CacheList, RotatingKVCache

from .ragged_kv import RaggedBatchKVCache

SLACK_MIN = 32  # columns the buffer may grow past the window before a compaction


class RaggedWindowKVCache(RaggedBatchKVCache):
    """A ragged batch KV cache whose rows each see only their last `max_size` positions."""

    max_size: int = 0

    @classmethod
    def from_batch_rotating(cls, c: BatchRotatingKVCache) -> RaggedWindowKVCache:
        """The window form of a batch window cache (mlx-lm's merge: not rotated)."""
        c._temporal_order()
        B = c.offset.shape[0]
        out = cls([0] * B)
        out.max_size = c.max_size
        out.left_padding, out.offset = c.left_padding, c.offset
        if c.keys is not None:
            out.keys, out.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
            out._idx = c._idx
        return out

    @classmethod
    def from_rows(cls, max_size: int, rows: list[tuple[Any, Any, int]]) -> RaggedWindowKVCache:
        """Rows (keys, values, offset) whose entries are the last positions before their
        offset, in order; each row keeps its last `max_size`, right-aligned."""
        out = cls([0] * len(rows))
        out.max_size = max_size
        lengths = [0 if k is None else min(k.shape[2], max_size) for k, _, _ in rows]
        width = max(lengths)
        out.offset = mx.array([o for _, _, o in rows])
        out.left_padding = mx.array([width - n for n in lengths])
        if width == 0:
            return out
        k0, v0 = next((k, v) for k, v, _ in rows if k is not None)
        keys = mx.zeros((len(rows), k0.shape[1], width, k0.shape[3]), k0.dtype)
        values = mx.zeros((len(rows), v0.shape[1], width, v0.shape[3]), v0.dtype)
        for i, ((k, v, _), n) in enumerate(zip(rows, lengths)):
            if n:
                keys[i : i + 1, :, width - n :] = k[..., k.shape[2] - n :, :]
                values[i : i + 1, :, width - n :] = v[..., v.shape[2] - n :, :]
        out.keys, out.values, out._idx = keys, values, width
        return out

    @property
    def slack(self) -> int:
        return max(SLACK_MIN, self.max_size // 4)

    # -- attention -------------------------------------------------------------------
    def _live(self, length: int) -> mx.array:
        """[B, length] True where a column holds one of the row's entries."""
        live = mx.arange(length)[None] >= self.left_padding[:, None]
        if self.holes is not None:
            live = live & ~self._hole_mask(length)
        return live

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any):
        """[B, 1, N, entries after the update]: a query at p sees its row's (p - W, p]."""
        window = self.max_size if window_size is None else min(window_size, self.max_size)
        live = self._live(self._idx + N)
        after = mx.cumsum(live.astype(mx.int32), axis=1, reverse=True)  # live entries from here on
        positions = (self.offset + N)[:, None] - after  # [B, T], meaningful where live
        queries = self.offset[:, None] + mx.arange(N)[None]  # [B, N]
        keys, queries = positions[:, None, :], queries[:, :, None]
        mask = live[:, None, :] & (keys <= queries) & (keys > queries - window)
        return mask[:, None]

    # -- eviction ----------------------------------------------------------------------
    def compaction_due(self) -> bool:
        if self.uncounted:
            return False
        return super().compaction_due() or self._idx >= self.max_size + self.slack

    def compact(self) -> None:
        """Gather each row's last W live entries, right-aligned (no step in flight)."""
        self._settled("compact")
        if self.keys is None:
            return
        live = self._live(self._idx).tolist()
        rows = [[p for p, ok in enumerate(row) if ok][-self.max_size :] for row in live]
        width = max(len(r) for r in rows)
        index = mx.array([[0] * (width - len(r)) + r for r in rows])
        gather = index[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys[..., : self._idx, :], gather, axis=2)
        self.values = mx.take_along_axis(self.values[..., : self._idx, :], gather, axis=2)
        self.left_padding = mx.array([width - len(r) for r in rows])
        self._idx = width
        self.holes, self.hole_counts = None, None

    # -- reshaping ---------------------------------------------------------------------
    def extend(self, other: Any) -> None:
        if getattr(other, "max_size", self.max_size) != self.max_size:
            raise ValueError("batch window caches merge only with the same window")
        super().extend(other)

    def extract(self, idx: int) -> RotatingKVCache:
        """Row `idx` as mlx-lm's single-sequence window cache (its last W entries)."""
        self._settled("extract")
        cache = RotatingKVCache(self.max_size)
        cache.offset = int(self.offset[idx].item())
        if self.keys is None:
            return cache
        columns = [p for p, ok in enumerate(self._live(self._idx)[idx].tolist()) if ok][-self.max_size :]
        if not columns:
            return cache
        keep = mx.array(columns)
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, keep])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, keep])
        cache._idx = cache.keys.shape[2]
        return cache

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        raise NotImplementedError("BatchRotatingKVCache Quantization NYI")  # mlx-lm's own refusal


def adopt(cache: list[Any]) -> list[Any]:
    """Replace the `BatchRotatingKVCache` leaves of a fresh merge by their window form (in place)."""
    for i, c in enumerate(cache):
        if type(c) is BatchRotatingKVCache:
            cache[i] = RaggedWindowKVCache.from_batch_rotating(c)
        elif isinstance(c, CacheList):
            adopt(c.caches)
    return cache
