"""Per-row rollback without moving data (melix_mlx.runtime.ragged_kv).

- A batch whose rows dropped different numbers of entries attends exactly like a batch
  built from the kept tokens alone: the next forward's logits match (max |diff| = 0 for
  the GQA family, < 1e-5 for MLA whose one- and multi-token kernels differ).
- Rolling back does not touch the key/value buffers (the same arrays before and after),
  so its cost does not depend on how the rows' accept lengths differ.
- Compaction, filter, extend and extract keep every row's live entries.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from melix_mlx.runtime import ragged_kv, rollback
from melix_mlx.runtime.hidden import forward_with_hidden
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
BLOCK = [[40, 41, 42, 43], [50, 51, 52, 53], [60, 61, 62, 63]]
KEEP = [4, 1, 2]


def _batch(model, prompts):
    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        forward_with_hidden(model, mx.array([p]), c)
        caches.append(c)
    return ragged_kv.adopt(_merge_caches(caches))


def _kv(cache):
    return [c for c in rollback.leaves(cache) if isinstance(c, ragged_kv.RaggedBatchKVCache)]


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3"])
def test_rows_dropped_differently_attend_like_clean_rows(loaded_heads, family: str) -> None:
    model = loaded_heads[family][0]
    cache = _batch(model, PROMPTS)
    forward_with_hidden(model, mx.array(BLOCK), cache)
    buffers = [(c.keys, c.values) for c in _kv(cache)]
    rollback.drop_row_suffixes(cache, [4 - n for n in KEEP])
    assert all(c.keys is k and c.values is v for c, (k, v) in zip(_kv(cache), buffers))  # nothing moved
    nxt = mx.array([[70], [71], [72]])
    got, _ = forward_with_hidden(model, nxt, cache)
    clean = _batch(model, [p + b[:n] for p, b, n in zip(PROMPTS, BLOCK, KEEP)])
    want, _ = forward_with_hidden(model, nxt, clean)
    tolerance = 0.0 if family == "mimo" else 1e-5
    assert mx.abs(got - want).max().item() <= tolerance
    for i, (p, n) in enumerate(zip(PROMPTS, KEEP)):
        for c in _kv(cache):
            assert c.extract(i).offset == len(p) + n + 1


def test_wrong_holes_are_visible(loaded_heads) -> None:
    """The comparison is sharp: keeping one rejected entry changes the logits."""
    model = loaded_heads["mimo"][0]
    cache = _batch(model, PROMPTS)
    forward_with_hidden(model, mx.array(BLOCK), cache)
    rollback.drop_row_suffixes(cache, [4 - n - (i == 1) for i, n in enumerate(KEEP)])
    got, _ = forward_with_hidden(model, mx.array([[70], [71], [72]]), cache)
    clean = _batch(model, [p + b[:n] for p, b, n in zip(PROMPTS, BLOCK, KEEP)])
    want, _ = forward_with_hidden(model, mx.array([[70], [71], [72]]), clean)
    assert mx.abs(got[1] - want[1]).max().item() > 0.0


def test_compact_filter_extend_keep_live_entries(loaded_heads) -> None:
    model = loaded_heads["mimo"][0]
    cache = _batch(model, PROMPTS)
    forward_with_hidden(model, mx.array(BLOCK), cache)
    rollback.drop_row_suffixes(cache, [4 - n for n in KEEP])
    kept = [p + b[:n] for p, b, n in zip(PROMPTS, BLOCK, KEEP)]

    def live(c, i):
        e = c.extract(i)
        return e.keys[..., : e.offset, :]

    before = [[live(c, i) for i in range(3)] for c in _kv(cache)]
    for c in _kv(cache):
        c.compact()
        assert c.holes is None
    for c, rows in zip(_kv(cache), before):
        for i in range(3):
            assert mx.array_equal(live(c, i), rows[i])
    # filter and extend with holes present
    forward_with_hidden(model, mx.array(BLOCK), cache)
    rollback.drop_row_suffixes(cache, [3, 0, 2])
    kept = [k + b[: 4 - d] for k, b, d in zip(kept, BLOCK, [3, 0, 2])]
    for c in cache:
        c.filter([0, 2])
    joined = _batch(model, [[80, 81]])
    for c, j in zip(cache, joined):
        c.extend(j)
    nxt = mx.array([[90], [91], [92]])
    got, _ = forward_with_hidden(model, nxt, cache)
    want, _ = forward_with_hidden(model, nxt, _batch(model, [kept[0], kept[2], [80, 81]]))
    assert mx.abs(got - want).max().item() == 0.0
