"""Rotating (sliding-window) KV caches with exact rollback: `max_kv_size` with MTP.

Greedy output equals mlx-lm's own `max_kv_size` decoding token for token (windows small
enough to wrap many times, depths 1-3, a head wrong every third draft so rollbacks run);
the windowed reference differs from the unwindowed one, so the comparison sees whether
the window is applied. A batch with `max_kv_size` (a window keeping its first tokens,
`rotating_keep`, which mlx-lm's batch cache drops) is refused, typed, as
spec/rollback.toml names it (windows from a checkpoint's own config, batched and
quantized: tests/adapters/test_compat_sliding_layers.py, test_batched_windows.py).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.runtime.window_kv import WindowedKVCache
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import make_prompt_cache
from scripted_head import ScriptedHead

from melix_fsm.reasons import RefusalReason

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 5, 17, 33, 2]
N = 32


@pytest.mark.parametrize("window", [8, 20])
@pytest.mark.parametrize("family", ["mimo", "deepseek_v3"])
def test_max_kv_size_equals_mlx_lm(tiny_checkpoint, family: str, window: int) -> None:
    model, _, head, _ = load_with_heads(tiny_checkpoint(family))
    want = reference(model, PROMPT, N, max_kv_size=window)
    assert want != reference(model, PROMPT, N)  # the window changes the output
    longer = reference(model, PROMPT, N + 4, max_kv_size=window)
    scripted = ScriptedHead([PROMPT + longer], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    for k in (1, 2, 3):
        for drafter in (head, scripted):
            cache = make_prompt_cache(model, max_kv_size=window)
            got, decoder = mtp(model, drafter, PROMPT, N, k, prompt_cache=cache)
            assert got == want, (family, window, k)
            assert decoder.stats["refusal"] is None
            assert all(isinstance(c, WindowedKVCache) for c in decoder.cache)
        assert decoder.stats["rollbacks"] > 0 and decoder.stats["accepted"] > 0


def test_stream_generate_max_kv_size(tiny_checkpoint) -> None:
    from melix_mlx.generate import mtp_stream_generate
    from mlx_lm.generate import stream_generate

    model, tokenizer, head, _ = load_with_heads(tiny_checkpoint("mimo"))
    want = [r.token for r in stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=N, max_kv_size=8)]
    out = list(mtp_stream_generate(model, tokenizer, PROMPT, head, N, num_draft_tokens=2, max_kv_size=8))
    assert [r.token for r in out] == want and out[-1].stats["refusal"] is None


def test_windowed_trim_restores_exactly() -> None:
    """Spare slots: entries a verify wrote past the window come back on trim."""
    cache = WindowedKVCache(max_size=6, keep=2)
    for p in range(10):  # one position at a time, values = positions
        x = mx.full((1, 1, 1, 1), float(p))
        cache.update_and_fetch(x, x)
    block = mx.arange(10, 14, dtype=mx.float32).reshape(1, 1, 4, 1)
    mask = cache.make_mask(4)
    cache.update_and_fetch(block, block)
    entries = cache.keys.reshape(-1).tolist()
    # each query of the block sees [0, keep) and its own last max_size - keep positions
    for i, row in enumerate(mask.tolist()):
        seen = [int(e) for e, m in zip(entries, row) if m]
        p = 10 + i
        assert seen == [0, 1, *range(p - 3, p + 1)]
    assert cache.trim(3) == 3 and cache.offset == 11  # three drafts rejected
    kept = [int(e) for e in cache.keys.reshape(-1).tolist()]
    assert kept == [0, 1, *range(cache.start, 11)]
    assert cache.start <= 11 - 4 + 1  # the next query (position 11) finds its whole window


def test_batched_max_kv_size_refused_typed(tiny_checkpoint) -> None:
    from melix_mlx.batch_generator import MTPBatchGenerator

    model, _, head, _ = load_with_heads(tiny_checkpoint("mimo"))
    gen = MTPBatchGenerator(model, head, max_kv_size=8)
    assert gen.refusal.startswith(RefusalReason.unsupported_cache_sharing.value)
    assert "rotating_keep" in gen.refusal  # the kept prefix, not the window, is refused
    gen.close()
