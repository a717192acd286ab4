"""DeepSeek-V4.1's per-layer cache (mlx-lm's `LayerCache`) with exact rollback.

Rules of this module:
- mlx-lm's `LayerCache` holds, per decoder layer, a sliding window of KV rows (the last
  `window_size`), the closed compressed groups (`compress_kv`, one latent per `ratio`
  positions) with their index keys (`index_k`), and the open group's projected rows
  (`pending_kv`, `pending_gate`). A verify writes several positions at once: the window
  evicts rows a rollback would expose again, and the compressor folds the open group's
  rows into a latent once `ratio` of them are there, so mlx-lm marks it untrimmable.
- `SpareLayerCache` keeps what a rollback can expose again, and nothing more:
  - the window keeps the W rows before the offset the forward started from, then the
    new rows (a rollback anywhere from that offset on finds mlx-lm's window). mlx-lm's model reads
    the window through indices relative to the rows the cache holds (the last W of them
    for each query), so extra rows in front change no attention; `trim(n)` drops the
    last n rows;
  - `tail_kv` / `tail_gate` are the compressor's projected rows from the open group's
    start (at the forward's starting offset) on: the capturing compressor (`install`)
    records them before mlx-lm's compressor folds them. `trim(n)` then truncates the
    closed groups to what `offset` closes (`offset // ratio`; `offset` for ratio 1) and
    rebuilds the open group from the tail;
  so `trim(n)` leaves the cache as a clean run over the remaining positions leaves it,
  with no forward replayed. A rollback never goes before the offset the last forward
  started from (the engine trims only what its verify wrote).
- The prompt is prefilled in mlx-lm's own LayerCache; `adopt` converts each leaf after
  the prefill (its open group's rows are its pending rows). The spare form stays a
  LayerCache mlx-lm's model decodes on as before; `to_layer_cache` gives mlx-lm's exact
  form (the last W window rows, no tail).
- The batch form does not exist (mlx-lm cannot merge a LayerCache): batching refuses
  the kind (spec/rollback.toml [[unmergeable]]); so does a quantized KV cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as dsv41


def _append(cached: mx.array | None, new: mx.array) -> mx.array:
    return new if cached is None else mx.concatenate([cached, new], axis=1)


class SpareLayerCache(dsv41.LayerCache):
    """A LayerCache whose trim is exact; see the module rules."""

    def __init__(self, window_size: int, ratio: int) -> None:
        super().__init__(window_size)
        self.ratio = ratio  # this layer's compressor ratio (0: it compresses nothing)
        self.tail_kv: mx.array | None = None
        self.tail_gate: mx.array | None = None

    @classmethod
    def from_layer_cache(cls, c: dsv41.LayerCache, ratio: int) -> SpareLayerCache:
        out = cls(c.window_size, ratio)
        out.offset, out.window = c.offset, c.window
        out.compress_kv, out.index_k = c.compress_kv, c.index_k
        out.pending_kv, out.pending_gate = c.pending_kv, c.pending_gate
        out.tail_kv, out.tail_gate = c.pending_kv, c.pending_gate
        return out

    def to_layer_cache(self) -> dsv41.LayerCache:
        out = dsv41.LayerCache(self.window_size)
        out.offset = self.offset
        out.window = None if self.window is None else self.window[:, -self.window_size :]
        out.compress_kv, out.index_k = self.compress_kv, self.index_k
        out.pending_kv, out.pending_gate = self.pending_kv, self.pending_gate
        return out

    def update_window(self, kv: mx.array) -> mx.array:
        window = _append(self.window, kv)
        # the window at the starting offset, then the new rows: a rollback to any
        # position from there on finds mlx-lm's window (its last W rows) again
        self.window = window[:, -(self.window_size + kv.shape[1]) :]
        self.offset += kv.shape[1]
        return window

    def record(self, kv: mx.array, gate: mx.array, start_pos: int) -> None:
        """The compressor's projected rows for positions [start_pos, start_pos + L)."""
        first = start_pos - start_pos % self.ratio  # the open group's start
        held = 0 if self.tail_kv is None else self.tail_kv.shape[1]
        cut = first - (start_pos - held)  # tail rows before the open group
        if cut < 0:
            raise RuntimeError("the compressor tail lost rows of its open group")
        self.tail_kv = _append(self.tail_kv, kv)[:, cut:]
        self.tail_gate = _append(self.tail_gate, gate)[:, cut:]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        if n <= 0:
            return 0
        if self.window is None or self.window.shape[1] < n:
            raise RuntimeError("a LayerCache rollback past its last forward's start")
        self.offset -= n
        self.window = self.window[:, : self.window.shape[1] - n]
        if self.ratio == 1:  # one compressed entry per position, nothing open
            self.compress_kv = _cut(self.compress_kv, self.offset)
            self.index_k = _cut(self.index_k, self.offset)
        elif self.ratio > 1:
            closed = self.offset // self.ratio
            self.compress_kv = _cut(self.compress_kv, closed)
            self.index_k = _cut(self.index_k, closed)
            if self.tail_kv is not None:
                held = self.tail_kv.shape[1] - n  # tail rows up to the new offset
                open_rows = self.offset % self.ratio
                if held < open_rows:
                    raise RuntimeError("the compressor tail lost rows of its open group")
                self.tail_kv = self.tail_kv[:, :held]
                self.tail_gate = self.tail_gate[:, :held]
                self.pending_kv = self.tail_kv[:, held - open_rows :]
                self.pending_gate = self.tail_gate[:, held - open_rows :]
        return n


def _cut(entries: mx.array | None, count: int) -> mx.array | None:
    return None if entries is None else entries[:, :count]


class CapturingCompressor(dsv41.Compressor):
    """mlx-lm's compressor, recording its projected rows into a `SpareLayerCache` first."""

    def __call__(self, x: mx.array, start_pos: int, cache: Any) -> Any:
        if self.ratio > 1 and isinstance(cache, SpareLayerCache):
            h = x.astype(mx.float32)  # as mlx-lm's compressor projects them
            cache.record(self.kv_proj(h), self.gate_proj(h), start_pos)
        return super().__call__(x, start_pos, cache)


def _ratios(model: Any) -> list[int]:
    """Each layer's compressor ratio (0 where the layer has no compressor)."""
    out = []
    for layer in model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        out.append(0 if comp is None else int(comp.ratio))
    return out


def install(model: Any) -> None:
    """Give every compressor of a DeepSeek-V4.1 model its capturing twin (in place; the
    twin computes exactly what mlx-lm's does, and records only into a SpareLayerCache)."""
    for layer in model.layers:
        comp = getattr(layer.self_attn, "compressor", None)
        if comp is not None and type(comp) is dsv41.Compressor:
            comp.__class__ = CapturingCompressor


def is_layer_cache(c: Any) -> bool:
    return isinstance(c, dsv41.LayerCache)


def adopt(cache: list[Any], model: Any) -> list[Any]:
    """Replace every mlx-lm LayerCache (in place) by its spare form; a no-op elsewhere."""
    if not any(type(c) is dsv41.LayerCache for c in cache):
        return cache
    install(model)
    for i, (c, ratio) in enumerate(zip(cache, _ratios(model), strict=True)):
        if type(c) is dsv41.LayerCache:
            cache[i] = SpareLayerCache.from_layer_cache(c, ratio)
    return cache
