"""Exact cache rollback after a verify forward, per row, for single and batched caches.

Rules of this module:
- Every row of a batched cache is one sequence; rolling one row back never touches
  another row's entries. A single-sequence cache is the one-row case.
- KV-like leaves are trimmed. A batch cache's `trim(n)` is uniform across rows, so
  `drop_row_suffixes` trims the rows' common rejected suffix and leaves each row's
  remaining rejected entries to the cache: melix_mlx.runtime.ragged_kv masks them as holes
  without moving data; a plain `BatchKVCache` (a caller's own) gets them as right
  padding rolled to the front by `finalize()`, mlx-lm's own mechanism. KV caches write
  in place, so they are never snapshotted by reference.
- Recurrent (ArraysCache) leaves are not trimmable. The verify captures their state at
  every position and rollback selects it (melix_mlx.runtime.capture). A cache whose recurrent
  layers cannot be captured has no exact rollback here and is refused. A `CacheMark`
  (KV offsets and a copy of each recurrent leaf's array list: the layer replaces its
  arrays on update, so the copy is cheap and exact) undoes a whole failed cycle.
- Which strategy a cache kind gets is spec/rollback.toml's (`strategy_of`), not a class
  check re-typed here; `unsupported_kinds` refuses what the spec refuses.
- A RotatingKVCache is exact only until it wraps: single sequences move it to
  melix_mlx.runtime.window_kv after the prefill, batches to melix_mlx.runtime.window_batch
  (strategy `window_spare`, a ragged leaf like any batch KV layer); one that keeps its
  first tokens (`rotating_keep`, mlx-lm's max_kv_size) has no batch form and a batch
  refuses it (`refusal(..., batched=True)`). Unknown kinds are reported by
  `unsupported_kinds` before decoding starts; nothing rolls back approximately.
- Where every leaf can (ragged batch KV, captured recurrent state), rollback runs inside
  the cycle's lazy graph from the device's accept counts (`in_graph`): the next cycle
  can then be built before this one's outcome reaches the host. Elsewhere (mlx-lm's
  single-sequence, quantized and windowed caches, whose offsets are host integers) it
  runs after the sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from . import capture
from .cache_leaves import leaves

_TRIMMABLE_KV = (KVCache, QuantizedKVCache)


def kind_of(c: Any) -> str:
    """The registry's name for a cache's kind."""
    if isinstance(c, QuantizedKVCache):
        return "quantized_kv"
    if isinstance(c, KVCache):
        return "kv"
    if isinstance(c, RotatingKVCache):
        return "rotating_keep" if c.keep else "rotating"
    if isinstance(c, ArraysCache):
        return "arrays"
    if _is_layer_cache(c):
        return "layer_cache"  # trimmable in its spare form only (melix_mlx.runtime.layer_kv)
    return type(c).__name__


def _is_layer_cache(c: Any) -> bool:
    """DeepSeek-V4.1's LayerCache, mlx-lm's or its spare form (no mlx-lm model import)."""
    return any(t.__name__ == "LayerCache" and t.__module__.endswith(".deepseek_v41") for t in type(c).__mro__)


def cache_kinds(cache: list[Any]) -> list[str]:
    return sorted({kind_of(c) for c in leaves(cache)})


@functools.cache
def _registry() -> Any:
    from melix_fsm.registry import load_registry

    return load_registry()


def strategy_of(c: Any) -> str | None:
    """spec/rollback.toml's strategy for this leaf's kind (None: refused or unknown kind)."""
    cell = _registry().cells.get((kind_of(c), False, False))
    return None if cell is None else cell.strategy


# What each spec strategy needs from a leaf at runtime.
_RUNS = {
    "trim": lambda c: isinstance(c, _TRIMMABLE_KV),
    "capture_select": lambda c: isinstance(c, ArraysCache),
    # melix_mlx.runtime.window_kv after prefill (batched: melix_mlx.runtime.window_batch)
    "window_spare": lambda c: isinstance(c, RotatingKVCache),
    # melix_mlx.runtime.layer_kv after prefill (single sequence: no batch form)
    "layer_spare": _is_layer_cache,
}


def unsupported_kinds(cache: list[Any], model: Any = None) -> list[str]:
    """Kinds without an exact rollback here (empty when all are supported).

    The strategy comes from the spec; a kind the spec refuses (a rotating cache trims
    exactly only until it wraps) or does not know is unsupported. `capture_select`
    also needs every recurrent layer of `model` to have a capturing twin
    (melix_mlx.runtime.capture): without one there is no exact rollback, and it is refused.
    """
    bad = set()
    for c in leaves(cache):
        strategy = strategy_of(c)
        if strategy not in _RUNS or not _RUNS[strategy](c):
            bad.add(kind_of(c))
    if model is not None and "arrays" not in bad and needs_capture(cache):
        capture.install(model)
        if not capture.supported(model, cache):
            bad.add("arrays")
    return sorted(bad)


def refusal(
    cache: list[Any], model: Any = None, *, batched: bool = False, quantized_kv: bool = False
) -> str | None:
    """The typed runtime refusal (`"<reason>: <detail>"`) for caches without exact rollback.

    `quantized_kv`: the decoder quantizes its KV cache (kv_bits); a kind whose quantized
    cell is a refusal (a window: mlx-lm cannot quantize one) is refused with that reason,
    as the receipt refuses it.

    The reason is the spec cell's (spec/rollback.toml) for the first refused kind; a kind
    the spec does not know, or recurrent layers without a capturing twin, are
    `unsupported_cache_sharing`.
    """
    from melix_fsm.reasons import RefusalReason, refusal_text

    if batched:  # kinds a batch cache cannot hold (spec/rollback.toml [[unmergeable]])
        for kind in cache_kinds(cache):
            blocked = _registry().unmergeable.get(kind)
            if blocked is not None:
                return refusal_text(blocked.refusal, f"batched cache kind {kind!r}: {blocked.message}")
    if quantized_kv:
        for kind in cache_kinds(cache):
            cell = _registry().cells.get((kind, True, False))
            if cell is not None and cell.refusal is not None:
                detail = f"cache kind {kind!r} with a quantized KV cache: {cell.message}"
                return refusal_text(cell.refusal, detail)
    bad = unsupported_kinds(cache, model=model)
    if not bad:
        return None
    reason, details = RefusalReason.unsupported_cache_sharing, []
    for kind in bad:
        cell = _registry().cells.get((kind, False, False))
        if cell is not None and cell.refusal is not None:
            reason = cell.refusal if not details else reason
            details.append(f"{kind} ({cell.message})")
        else:
            details.append(kind)
    return refusal_text(reason, f"cache kinds without exact rollback: {'; '.join(details)}")


def needs_capture(cache: list[Any]) -> bool:
    return any(isinstance(c, ArraysCache) for c in leaves(cache))


needs_replay = needs_capture  # the name the cost model's callers use: true where capture is needed


@dataclass
class CacheMark:
    """Where every cache leaf stood before a forward (KV offsets and recurrent array lists),
    to put it back after a failed cycle. Not a model checkpoint: nothing is written."""

    offsets: list[Any]  # per leaf: KV offset (int, or the per-row array of a batch cache)
    indices: list[int | None]  # per leaf: a batch cache's write index, else None
    arrays: list[list[Any] | None]  # per leaf: copied ArraysCache list, or None
    holes: list[Any]  # per ragged leaf: its hole mask (None: no holes, or not ragged)
    uncounted: list[int]  # per ragged leaf: in-graph rollbacks not yet counted by the host


def mark(cache: list[Any]) -> CacheMark:
    offsets: list[Any] = []
    indices: list[int | None] = []
    arrays: list[list[Any] | None] = []
    holes: list[Any] = []
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            offsets.append(None)
            indices.append(None)
            arrays.append(list(c.cache))
        else:
            offsets.append(c.offset)
            indices.append(getattr(c, "_idx", None))
            arrays.append(None)
        holes.append(getattr(c, "holes", None))
    return CacheMark(offsets, indices, arrays, holes, [getattr(c, "uncounted", 0) for c in leaves(cache)])


def restore(cache: list[Any], cp: CacheMark, voided_drops: int | None = None) -> None:
    """Put every layer back exactly where the mark was taken.

    `voided_drops`: in-graph rollbacks launched since the mark and never settled (their
    holes go with the restored mask; the host never counted them). The host counts of
    rollbacks settled since stay: those cycles were launched before the mark. None: no
    step settled since the mark, its own count comes back.
    """
    rows = zip(leaves(cache), cp.offsets, cp.indices, cp.arrays, cp.holes, cp.uncounted)
    for c, offset, index, saved, holes, uncounted in rows:
        if saved is not None:
            c.cache = list(saved)
        elif hasattr(c, "drop_rows"):  # ragged: the entries past the mark's index are garbage again
            c._idx, c.offset, c.holes = index, offset, holes
            c.uncounted = uncounted if voided_drops is None else c.uncounted - voided_drops
        elif index is not None:
            extra = c._idx - index
            if extra > 0:
                c.trim(extra)
        else:
            extra = c.offset - offset
            if extra > 0:
                c.trim(extra)


def in_graph(cache: list[Any]) -> bool:
    """Whether every leaf rolls back inside the lazy graph (see the module rules)."""
    return all(hasattr(c, "drop_rows") or isinstance(c, ArraysCache) for c in leaves(cache))


def drop_row_suffixes(
    cache: list[Any], drop: list[int] | mx.array, *, skip_recurrent: bool = False
) -> None:
    """Remove the last drop[i] entries of row i from every KV leaf.

    `drop` is host integers, or a device array (lazy, inside the cycle's graph: only for
    caches `in_graph` accepts; `count_holes` later gives the host its values).
    Recurrent leaves cannot drop entries: they raise, unless `skip_recurrent` says the
    caller has already set them (captured states).
    """
    if isinstance(drop, mx.array):
        for c in leaves(cache):
            if isinstance(c, ArraysCache):
                if not skip_recurrent:
                    raise TypeError("recurrent layers cannot drop entries; select captured states instead")
                continue
            c.drop_rows(drop)  # AttributeError: a caller skipped the in_graph check
        return
    if not drop or not any(drop):
        return
    common = min(drop)
    extra = [d - common for d in drop]
    for c in leaves(cache):
        if isinstance(c, ArraysCache):
            if skip_recurrent:
                continue
            raise TypeError("recurrent layers cannot drop entries; select captured states instead")
        if hasattr(c, "drop_rows"):  # melix_mlx.runtime.ragged_kv: holes, no data moved
            c.drop_rows(drop)
            continue
        if common:
            c.trim(common)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()


def count_holes(cache: list[Any], drop: list[int], *, at_tail: bool = False) -> None:
    """The host's values of an in-graph `drop_row_suffixes`, once the cycle is synced
    (`at_tail`: nothing was written since, the rows' common holes are trimmed)."""
    for c in leaves(cache):
        if hasattr(c, "count_holes"):
            c.count_holes(drop, at_tail=at_tail)


def compaction_due(cache: list[Any]) -> bool:
    """Whether some ragged leaf has grown enough holes to reclaim (host counts)."""
    return any(c.compaction_due() for c in leaves(cache) if hasattr(c, "compaction_due"))


def compact_if_due(cache: list[Any]) -> None:
    """Reclaim ragged holes where they grew too many (only with no cycle in flight)."""
    for c in leaves(cache):
        if hasattr(c, "compaction_due") and c.compaction_due():
            c.compact()


def trim_all(cache: list[Any], n: int) -> None:
    """Trim n tokens from every (trimmable) layer, e.g. a head's own KV cache."""
    if n <= 0:
        return
    for c in leaves(cache):
        c.trim(n)
