"""Batched sliding-window layers (melix_mlx.runtime.window_batch), speculated on exactly.

The windowed model is a llama whose `layer_types` marks one sliding layer (window 8,
tests/adapters/compat_models.py): mlx-lm gives that layer a RotatingKVCache, the other a
KVCache, and the draft-model method (or a scripted head) speculates on it. What holds:
- the batch window cache masks each row's window by position, over left padding and
  rolled-back holes; a rollback exposes the spare entries again; a compaction keeps each
  row's last W entries and hands a row back as mlx-lm's RotatingKVCache;
- MTPBatchGenerator's greedy tokens equal mlx-lm's (its single-sequence decode and its
  BatchGenerator) for rows at k = 1, 2, 3 whose prompts and outputs cross the window many
  times, with a scripted head wrong every third draft (rollbacks) and a real draft model,
  a late joiner, a removed row, and compactions during the run; rows decoding plainly
  keep the window bounded (compacted between plain steps);
- after rejecting cycles every row's caches equal a clean single-sequence run fed only
  its confirmed tokens (float32 rounding of batched matmuls allowed);
- a quantized KV cache refuses speculation on the window, typed (mlx-lm cannot quantize
  one), and decodes as mlx-lm does.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from compat_models import make_llama
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.decoding.draft_model import DraftHead
from melix_mlx.runtime import window_batch
from melix_mlx.runtime.ragged_kv import RaggedBatchKVCache
from melix_mlx.runtime.window_batch import RaggedWindowKVCache
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model
from scripted_head import ScriptedHead

from melix_fsm.reasons import RefusalReason

WINDOW = 8
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}
PROMPTS = [
    [72, 101, 108, 108, 111, 44, 32, 119, 5, 17, 33, 2, 40, 41, 42, 43, 44, 45, 46],  # > WINDOW
    [5, 17, 33],
    [100, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
]
N = 40
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    root: Path = tmp_path_factory.mktemp("batched-windows")
    target, _ = load_model(make_llama(root / "target", seed=1, **SLIDING))
    draft, _ = load_model(make_llama(root / "draft", seed=2))
    return {"target": target, "draft": draft}


# -- the cache ---------------------------------------------------------------------------
def _rows(lengths: list[int], window: int) -> RaggedWindowKVCache:
    """A batch window cache whose entries hold their own positions (one value each)."""
    rows = []
    for n in lengths:
        c = RotatingKVCache(max_size=window)
        for p in range(n):
            x = mx.full((1, 1, 1, 1), float(p))
            c.update_and_fetch(x, x)
        rows.append(c)
    merged = window_batch.adopt([rows[0].merge(rows)])[0]
    assert type(merged) is RaggedWindowKVCache
    return merged


def _write(cache: RaggedWindowKVCache, n: int) -> list[list[list[int]]]:
    """Write n positions per row; the positions each query saw, per row and query."""
    offsets = cache.offset.tolist()
    block = mx.array([[list(range(o, o + n))] for o in offsets], dtype=mx.float32)[..., None]
    mask = cache.make_mask(n)
    keys, _ = cache.update_and_fetch(block, block)
    seen = []
    for i in range(len(offsets)):
        entries = keys[i, 0, :, 0].tolist()
        rows = mask[i, 0].tolist()
        seen.append([[int(e) for e, m in zip(entries, row) if m] for row in rows])
    return seen


def _window(p: int, w: int) -> list[int]:
    return list(range(max(0, p - w + 1), p + 1))


@pytest.mark.parametrize("lazy", [False, True])
def test_each_row_sees_its_window_across_rollbacks_and_compaction(lazy: bool) -> None:
    w = 4
    cache = _rows([10, 3], w)  # row 1 is left-padded
    seen = _write(cache, 3)
    assert seen == [[_window(p, w) for p in (10, 11, 12)], [_window(p, w) for p in (3, 4, 5)]]
    drop = [2, 1]  # row 0 keeps position 10, row 1 keeps 3 and 4
    if lazy:  # inside the cycle's graph, counted once synced
        cache.drop_rows(mx.array(drop))
        cache.count_holes(drop, at_tail=True)
    else:
        cache.drop_rows(drop)
    assert cache.offset.tolist() == [11, 5]
    for _ in range(3):  # the rejected positions are written again, each row sees its window
        before = cache.offset.tolist()
        seen = _write(cache, 2)
        assert seen == [[_window(p, w) for p in (o, o + 1)] for o in before]
    cache.compact()
    assert cache.holes is None and cache._idx == w
    for i, offset in enumerate(cache.offset.tolist()):
        row = cache.extract(i)
        assert type(row) is RotatingKVCache and row.offset == offset
        assert row.keys[0, 0, :, 0].tolist() == list(range(offset - w, offset))
    assert _write(cache, 1) == [[_window(p, w)] for p in (17, 11)]


def test_compaction_is_due_past_the_slack_and_only_when_settled() -> None:
    cache = _rows([3, 3], 4)
    while cache._idx < 4 + cache.slack - 1:
        _write(cache, 1)
    assert not cache.compaction_due()
    _write(cache, 1)
    assert cache.compaction_due()
    cache.drop_rows(mx.array([0, 1]))  # a rollback in flight: no reshaping now
    assert not cache.compaction_due()
    with pytest.raises(RuntimeError):
        cache.compact()


# -- the generator -----------------------------------------------------------------------
def _drain(gen: MTPBatchGenerator, join_at: int | None = None, remove_at: int | None = None):
    """Tokens per uid; a late joiner (PROMPTS[2]) inserted and the first row removed on cue."""
    out: dict[int, list[int]] = {}
    late = None
    for step in range(400):
        if step == join_at:
            late = gen.insert([PROMPTS[2]], num_draft_tokens=[1])[0]
        if step == remove_at:
            gen.remove([gen.batch.uids[0]])
        if not (gen.batch.uids or gen._queue):
            return out, late
        for r in gen.next()[1]:
            out.setdefault(r.uid, []).append(r.token)
    raise AssertionError("the generator did not finish")


def test_mlx_lm_batch_generator_agrees_with_its_single_decode(models) -> None:
    """The references agree: mlx-lm's BatchGenerator windows its rows as one decode does."""
    target = models["target"]
    reference_gen = BatchGenerator(target, max_tokens=N)
    uids = reference_gen.insert(PROMPTS)
    want: dict[int, list[int]] = {}
    while responses := reference_gen.next_generated():
        for r in responses:
            want.setdefault(r.uid, []).append(r.token)
    reference_gen.close()
    assert [want[u] for u in uids] == [reference(target, p, N) for p in PROMPTS]


@pytest.mark.parametrize(
    ("drafter", "run_ahead"), [("scripted", False), ("draft_model", False), ("scripted", True)]
)
def test_batched_greedy_equals_mlx_lm_with_joins_and_removals(
    models, drafter: str, run_ahead: bool, monkeypatch
) -> None:
    """`run_ahead`: the next cycle is built before this one syncs (the GPU default): the
    rollback runs in the graph, the hole counts catch up later, compaction waits."""
    target = models["target"]
    refs = [reference(target, p, N) for p in PROMPTS]
    scripts = [p + reference(target, p, N + 4) for p in PROMPTS]
    head = (
        ScriptedHead(scripts, 1024, 64, wrong_every=3)
        if drafter == "scripted"
        else DraftHead(models["draft"])
    )
    compactions = []
    compact = RaggedWindowKVCache.compact
    monkeypatch.setattr(RaggedWindowKVCache, "compact", lambda c: compactions.append(c._idx) or compact(c))

    gen = MTPBatchGenerator(target, head, max_tokens=N, run_ahead=run_ahead)
    assert gen.refusal is None
    uids = gen.insert(PROMPTS[:2], num_draft_tokens=[2, 3])
    out, late = _drain(gen, join_at=4)
    assert [out[u] for u in [*uids, late]] == refs
    stats = gen.speculative_stats()
    assert stats["cycles"] > 0 and stats["rollbacks"] > 0 and stats["replay_forwards"] == 0
    assert compactions  # the windows were reclaimed during the run
    gen.close()

    gen = MTPBatchGenerator(target, head, max_tokens=N, run_ahead=run_ahead)  # a row leaves mid-run
    uids = gen.insert(PROMPTS, num_draft_tokens=[1, 2, 3])
    out, _ = _drain(gen, remove_at=6)
    removed, kept = uids[0], uids[1:]
    assert 0 < len(out[removed]) < N and out[removed] == refs[0][: len(out[removed])]
    assert [out[u] for u in kept] == refs[1:]
    gen.close()


def test_rows_caches_after_rejections_equal_a_clean_run(models) -> None:
    target = models["target"]
    scripts = [p + reference(target, p, N + 4) for p in PROMPTS]
    gen = MTPBatchGenerator(target, ScriptedHead(scripts, 1024, 64, wrong_every=3), max_tokens=N)
    gen.insert(PROMPTS, num_draft_tokens=[3, 2, 3])
    for _ in range(9):
        gen.next()
    assert gen.speculative_stats()["rollbacks"] > 0
    cache = gen.engine.cache
    assert [type(c) for c in cache] == [RaggedWindowKVCache, RaggedBatchKVCache]
    for i, row in enumerate(gen.batch.rows):
        context = row.payload.context  # every token the row's caches hold, in order
        assert len(context) > 2 * WINDOW
        clean = make_prompt_cache(target)
        for t in context:  # fed one token at a time: no verify, nothing rolled back
            target(mx.array([[t]]), cache=clean)
        got = [c.extract(i) for c in cache]
        assert [type(c) for c in got] == [RotatingKVCache, KVCache]
        for mine, theirs in zip(got, clean):
            assert mine.offset == theirs.offset == len(context)
            k_mine, v_mine = mine.state[:2]
            k_theirs, v_theirs = (
                (theirs._temporal_order(x) for x in theirs.state[:2])
                if isinstance(theirs, RotatingKVCache)
                else (x[..., : theirs.offset, :] for x in theirs.state[:2])
            )
            assert k_mine.shape == k_theirs.shape
            assert mx.abs(k_mine - k_theirs).max().item() < TOLERANCE
            assert mx.abs(v_mine - v_theirs).max().item() < TOLERANCE
    gen.close()


def test_plain_steps_keep_the_window_bounded(models, monkeypatch) -> None:
    """Rows that decode plainly (here: refused) grow the windows one column per step; the
    step pipeline pauses its run-ahead once a compaction is due, so they stay bounded, and
    the tokens stay mlx-lm's."""
    target = models["target"]
    widths: list[int] = []
    compact = RaggedWindowKVCache.compact
    monkeypatch.setattr(RaggedWindowKVCache, "compact", lambda c: widths.append(c._idx) or compact(c))
    gen = MTPBatchGenerator(
        target, DraftHead(models["draft"]), max_tokens=N, refusal="unsupported_model: plain here"
    )
    uids = gen.insert(PROMPTS)
    out, _ = _drain(gen)
    assert [out[u] for u in uids] == [reference(target, p, N) for p in PROMPTS]
    assert gen.speculative_stats()["cycles"] == 0
    slack = max(window_batch.SLACK_MIN, WINDOW // 4)  # RaggedWindowKVCache.slack
    assert widths and max(widths) <= WINDOW + slack + 1
    gen.close()


def test_a_quantized_kv_cache_refuses_the_window_typed(models) -> None:
    """kv_bits: mlx-lm cannot quantize a window, so the decoder refuses speculation with the
    spec's typed reason (as the receipt does) and decodes as mlx-lm does; a model without
    windows speculates on its quantized cache."""
    target, draft = models["target"], models["draft"]
    prompt = PROMPTS[0]
    quantized = {"kv_bits": 4, "kv_group_size": 16}
    got, decoder = mtp(target, DraftHead(draft), prompt, 8, 2, **quantized)
    assert decoder.stats["refusal"].startswith(RefusalReason.unsupported_quantization.value)
    assert "rotating" in decoder.stats["refusal"] and decoder.stats["cycles"] == 0
    assert got == reference(target, prompt, 8, **quantized)
    got, decoder = mtp(draft, DraftHead(draft), prompt, 8, 2, **quantized)
    assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0
