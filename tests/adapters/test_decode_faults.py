"""Faults: an exception in a speculative forward costs no token and changes no output.

An exception raised by the head (its Nth call) or by the verify forward (after the
forward has written the caches, the harder case) moves the sequence to `faulted`: the
caches are restored, pending drafts are dropped, and decoding continues plainly. The
output equals mlx-lm's, and the stats record one fault with its message.
"""

from __future__ import annotations

import melix_mlx.runtime.engine as engine_mod
import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.decode import MTPDecoder
from melix_mlx.generate import mtp_stream_generate
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.tools.tiny import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from scripted_head import ScriptedHead

N = 20
PROMPT = [104, 101, 97, 100, 33]


def _assert_faulted_once(stats: dict, message: str) -> None:
    assert stats["faults"] == 1
    assert stats["state"] == "faulted"
    assert message in stats["fault"]
    assert stats["plain_steps"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_head_exception(loaded_heads, family: str, monkeypatch) -> None:
    model, tokenizer, head, _ = loaded_heads[family]
    want = reference(model, PROMPT, N)
    real = type(head).__call__
    calls = {"n": 0}

    def flaky(self, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("head exploded on call 3")
        return real(self, *args, **kw)

    monkeypatch.setattr(type(head), "__call__", flaky)
    got, decoder = mtp(model, head, PROMPT, N, 2)
    assert got == want
    _assert_faulted_once(decoder.stats, "RuntimeError: head exploded on call 3")
    assert calls["n"] == 3  # a faulted sequence never calls the head again
    # the same through the stream_generate drop-in: stats ride on the responses
    calls["n"] = 0
    responses = list(mtp_stream_generate(model, tokenizer, PROMPT, head, N, num_draft_tokens=2))
    assert [r.token for r in responses] == want
    _assert_faulted_once(responses[-1].stats, "head exploded")


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_exception_after_cache_writes(loaded_heads, family: str, monkeypatch) -> None:
    model = loaded_heads[family][0]
    want = reference(model, PROMPT, N)
    # a perfect scripted head: the fault hits a sequence with accepted drafts behind it
    head = ScriptedHead([PROMPT + want], VOCAB_SIZE, main_parts(model).args.hidden_size)
    verifies = {"n": 0}

    def failing(model_, inputs, cache=None, **kw):
        out = forward_with_hidden(model_, inputs, cache, **kw)  # caches already written
        if inputs.shape[1] > 1:
            verifies["n"] += 1
            if verifies["n"] == 2:
                mx.eval(out)
                raise ValueError("verify failed")
        return out

    monkeypatch.setattr(engine_mod, "forward_with_hidden", failing)
    got, decoder = mtp(model, head, PROMPT, N, 3)
    assert got == want
    stats = decoder.stats
    _assert_faulted_once(stats, "ValueError: verify failed")
    assert stats["accepted"] == 3  # the first cycle, before the fault
    assert stats["discarded"] == 3  # the faulted cycle's drafts, never emitted


def test_a_broken_logits_processor_is_the_callers_error(loaded_heads) -> None:
    """A caller's processor that raises is not swallowed as a speculative fault."""
    model, _, head, _ = loaded_heads["mimo"]
    calls = {"n": 0}

    def broken(history, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ZeroDivisionError("user bug")
        return logits

    decoder = MTPDecoder(model, head, num_draft_tokens=2, logits_processors=[broken])
    with pytest.raises(ZeroDivisionError, match="user bug"):
        for _ in decoder.generate(mx.array(PROMPT), N):
            pass
    assert decoder.stats["faults"] == 0


def test_a_broken_processor_in_a_plain_step_is_the_callers_error(loaded_heads) -> None:
    model, _, _, _ = loaded_heads["mimo"]

    def broken(history, logits):
        if history.size > len(PROMPT) + 2:
            raise ZeroDivisionError("user bug")
        return logits

    decoder = MTPDecoder(model, None, logits_processors=[broken])  # no head: plain steps only
    with pytest.raises(ZeroDivisionError, match="user bug"):
        for _ in decoder.generate(mx.array(PROMPT), N):
            pass


def test_an_engine_bug_outside_the_forwards_is_not_a_fault(loaded_heads, monkeypatch) -> None:
    """Only the model and head forwards fault a row; an error elsewhere in the cycle (here a
    planted one in the acceptance rule) is this package's bug and surfaces as itself, with
    the caches put back, instead of quietly decoding plainly."""
    model, _, head, _ = loaded_heads["deepseek_v3"]

    def planted(*args, **kw):
        raise IndexError("planted engine bug")

    monkeypatch.setattr(engine_mod.CycleEngine, "_accept", planted)
    decoder = MTPDecoder(model, head, num_draft_tokens=2)
    with pytest.raises(IndexError, match="planted engine bug"):
        for _ in decoder.generate(mx.array(PROMPT), N):
            pass
    assert decoder.stats["faults"] == 0
    offsets = {c.offset for c in decoder.cache}
    assert offsets == {len(PROMPT)}  # the failed cycle left no position behind
