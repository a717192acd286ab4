"""Rollback exactness: after rejected drafts the main cache equals a clean run's.

The decoder runs a few cycles with partial acceptance (scripted head wrong every 3rd
position, k = 3) or total rejection (the random tiny head, k = 2) and is paused at a
cycle boundary. Its cache is then compared, layer by layer (KV keys/values up to the
offset, every ArraysCache array), with a fresh cache fed only the confirmed tokens:

- qwen3_5 (KVCache + recurrent ArraysCache: the state captured inside the verify at the
  accepted length, no replay) and mimo (KVCache, trim):
  bitwise equal (max |diff| = 0 on the CPU wheel) to feeding the confirmed tokens one
  by one AND to feeding them in the decoder's kept chunks.
- deepseek_v3 (KVCache, trim): mlx-lm's multi-token latent attention expands the whole
  cached context (a prefill form) and differed from its one-token form by ~2.4e-6. The
  verify now runs the absorbed one-token form for every row (melix_mlx.runtime.absorbed_mla),
  and its cache equals token-by-token decoding bit for bit; it also equals a clean run
  making the same forwards (the recorded verify chunks, each trimmed to its kept prefix).
"""

from __future__ import annotations

from typing import Any

import melix_mlx.runtime.engine as engine_mod
import mlx.core as mx
import pytest
from decode_refs import reference
from melix_mlx.decode import MTPDecoder
from melix_mlx.runtime import absorbed_mla, rollback
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.runtime.prefill import prefill_with_hidden
from melix_mlx.tools.tiny import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from scripted_head import ScriptedHead

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
CYCLES = 6


def max_diff(a: list[Any], b: list[Any]) -> float:
    worst = 0.0
    la, lb = rollback.leaves(a), rollback.leaves(b)
    assert [type(c) for c in la] == [type(c) for c in lb]
    for x, y in zip(la, lb):
        if isinstance(x, ArraysCache):
            for u, v in zip(x.cache, y.cache, strict=True):
                assert (u is None) == (v is None)
                if u is not None:
                    worst = max(worst, mx.abs(u - v).max().item())
        else:
            assert x.offset == y.offset
            n = x.offset
            for u, v in ((x.keys, y.keys), (x.values, y.values)):
                worst = max(worst, mx.abs(u[..., :n, :] - v[..., :n, :]).max().item())
    return worst


def run_cycles(model, head, k: int, monkeypatch) -> tuple[MTPDecoder, list[list[int]], list[list[int]]]:
    """Decode CYCLES cycles; return the decoder, kept chunks and the verify chunks fed."""
    fed: list[list[int]] = []

    def recording(model_, inputs, cache=None, **kw):
        fed.append(inputs[0].tolist())
        return forward_with_hidden(model_, inputs, cache, **kw)

    monkeypatch.setattr(engine_mod, "forward_with_hidden", recording)
    decoder = MTPDecoder(model, head, num_draft_tokens=k)
    gen = decoder.generate(mx.array(PROMPT), 1000)
    last = next(gen)[0]
    kept: list[list[int]] = []
    chunk = [last]
    while len(kept) < CYCLES:
        token, _, from_draft = next(gen)
        if from_draft:
            chunk.append(token)
        else:  # the bonus token closes a cycle; it is not in the cache yet
            kept.append(chunk)
            chunk = [token]
    monkeypatch.undo()
    verifies = [f for f in fed if len(f) == k + 1]
    assert len(verifies) >= CYCLES  # the next cycle may already be launched (pipelined)
    verifies = verifies[:CYCLES]
    return decoder, kept, verifies


def clean_cache(
    model, chunks: list[list[int]], keep: list[int] | None = None, verify_form: bool = False
) -> list[Any]:
    """A cache fed the prompt then `chunks`; `verify_form`: each chunk as the engine's verify runs it."""
    cache = make_prompt_cache(model)
    prefill_with_hidden(model, mx.array(PROMPT), cache)
    for i, chunk in enumerate(chunks):
        marked = absorbed_mla.arm(rollback.leaves(cache)) if verify_form else []
        forward_with_hidden(model, mx.array([chunk]), cache)
        absorbed_mla.disarm(marked)
        if keep is not None:
            rollback.trim_all(cache, len(chunk) - keep[i])
    return cache


def heads(loaded_heads, family: str) -> list[tuple[str, Any, int]]:
    model, _, head, _ = loaded_heads[family]
    script = PROMPT + reference(model, PROMPT, 40)
    scripted = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    return [("partial", scripted, 3), ("random", head, 2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_equals_clean_run(loaded_heads, family: str, monkeypatch) -> None:
    model = loaded_heads[family][0]
    for name, head, k in heads(loaded_heads, family):
        decoder, kept, verifies = run_cycles(model, head, k, monkeypatch)
        assert decoder.stats["rollbacks"] == CYCLES, name  # every cycle rejected something
        tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
        if family == "deepseek_v3":
            same_forwards = clean_cache(model, verifies, keep=[len(c) for c in kept], verify_form=True)
            assert max_diff(decoder.cache, same_forwards) == 0.0, name
            assert max_diff(decoder.cache, tokenwise) == 0.0, name
        else:
            assert max_diff(decoder.cache, tokenwise) == 0.0, name
            assert max_diff(decoder.cache, clean_cache(model, kept)) == 0.0, name
        assert decoder.stats["replay_forwards"] == 0  # recurrent layers select captured states


def test_comparison_sees_a_wrong_rollback(loaded_heads, monkeypatch) -> None:
    """The comparison is sharp: a rollback that keeps one rejected token is caught."""
    model = loaded_heads["mimo"][0]
    _, head, k = heads(loaded_heads, "mimo")[1]
    real = rollback.drop_row_suffixes

    def off_by_one(cache, drop, **kw):  # the same bug in the graph (device array) or after the sync
        if isinstance(drop, mx.array):
            return real(cache, mx.maximum(drop - 1, 0), **kw)
        return real(cache, [max(d - 1, 0) for d in drop], **kw)

    monkeypatch.setattr(engine_mod.rollback, "drop_row_suffixes", off_by_one)
    decoder = MTPDecoder(model, head, num_draft_tokens=k)
    gen = decoder.generate(mx.array(PROMPT), 1000)
    tokens = [next(gen)[0] for _ in range(4)]
    monkeypatch.undo()
    clean = clean_cache(model, [[t] for t in tokens[:-1]])
    with pytest.raises(AssertionError):
        assert max_diff(decoder.cache, clean) == 0.0
