"""Greedy identity: MTP decoding emits exactly mlx-lm's own greedy tokens.

For every family (qwen3_5: KV + recurrent ArraysCache; deepseek_v3: MLA KV; mimo: KV)
and depth k in {1, 2, 3}, on Hypothesis-drawn prompts: `MTPDecoder`, `mtp_generate_step`
and `mtp_stream_generate` equal `mlx_lm.generate.generate_step` / `stream_generate` token
for token, also with a repetition-penalty logits processor and with stop sequences.
The random tiny heads reject almost every draft here, so these runs exercise the reject
and rollback path; test_decode_acceptance.py covers acceptance with scripted heads.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from decode_refs import cut_at_stop, mtp, reference
from hypothesis import given, settings
from hypothesis import strategies as st
from melix_mlx.generate import mtp_generate_step, mtp_stream_generate
from melix_mlx.tools.tiny import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

N = 14
prompts = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(loaded_heads, family: str, k: int) -> None:
    model, _, head, _ = loaded_heads[family]

    @settings(max_examples=3, deadline=None)
    @given(prompt=prompts, penalty=st.booleans())
    def check(prompt: list[int], penalty: bool) -> None:
        procs = make_logits_processors(repetition_penalty=1.3) if penalty else None
        want = reference(model, prompt, N, logits_processors=procs)
        got, decoder = mtp(model, head, prompt, N, k, logits_processors=procs)
        assert got == want
        assert decoder.stats["faults"] == 0 and decoder.stats["refusal"] is None
        assert decoder.stats["cycles"] > 0  # it speculated, not a plain-decode fallback

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_running_ahead(loaded_heads, family: str) -> None:
    """Step n + 1 built before step n syncs (the GPU default; forced here): the same tokens,
    real cycles, and the caller's cache handed back in mlx-lm's single-sequence form
    holding exactly the prompt and every token but the last."""
    model, _, head, _ = loaded_heads[family]

    @settings(max_examples=3, deadline=None)
    @given(prompt=prompts)
    def check(prompt: list[int]) -> None:
        cache = make_prompt_cache(model)
        got, decoder = mtp(model, head, prompt, N, 2, run_ahead=True, prompt_cache=cache)
        assert got == reference(model, prompt, N)
        assert decoder.stats["cycles"] > 0 and decoder.stats["faults"] == 0
        assert all(type(c) in (KVCache, ArraysCache) for c in cache)
        offsets = {c.offset for c in cache if isinstance(c, KVCache)}
        assert offsets == {len(prompt) + N - 1}

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_step_wrapper(loaded_heads, family: str) -> None:
    model, _, head, _ = loaded_heads[family]
    prompt = [3, 141, 59, 26, 53]
    want = reference(model, prompt, N)
    out = list(mtp_generate_step(mx.array(prompt), model, head, max_tokens=N, num_draft_tokens=2))
    assert [t for t, _, _ in out] == want
    assert all(lp.shape == (VOCAB_SIZE,) for _, lp, _ in out)
    assert list(mtp_generate_step(mx.array(prompt), model, head, max_tokens=0)) == []
    with pytest.raises(ValueError, match="input_embeddings"):  # kv_bits runs: test_kv_quant.py
        list(mtp_generate_step(mx.array(prompt), model, head, input_embeddings=mx.zeros((5, 8))))


def streamed_text(tokenizer, tokens: list[int]) -> str:
    """What mlx-lm's streaming detokenizer makes of `tokens` (it differs from decode()
    on some byte tokens, e.g. 0x00)."""
    detokenizer = tokenizer.detokenizer
    text = ""
    for t in tokens:
        detokenizer.add_token(t)
        text += detokenizer.last_segment
    detokenizer.finalize()
    return text + detokenizer.last_segment


def _fields(r) -> tuple:
    return (r.token, r.text, r.finish_reason, r.generation_tokens, r.prompt_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_generate_parity(loaded_heads, family: str) -> None:
    """Same responses as mlx-lm's stream_generate (text, finish, counts), for str prompts."""
    model, tokenizer, head, _ = loaded_heads[family]
    for max_tokens in (1, 2, N):
        want = list(stream_generate(model, tokenizer, "Hello, world", max_tokens=max_tokens))
        got = list(
            mtp_stream_generate(model, tokenizer, "Hello, world", head, max_tokens, num_draft_tokens=3)
        )
        assert [_fields(r) for r in got] == [_fields(r) for r in want]
        last = got[-1]
        assert last.stats["target_forwards"] >= 0 and "per_position_acceptance" in last.stats
        for r, w in zip(got, want):
            if family == "deepseek_v3":
                # MLA runs a different kernel path for 1 token than for a verify chunk
                # (absorbed vs expanded kv_b): logprobs agree to ~1e-5, not bitwise.
                assert mx.allclose(r.logprobs, w.logprobs, atol=1e-4, rtol=0).item()
            else:
                assert mx.array_equal(r.logprobs, w.logprobs).item()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_eos_and_stop_sequences(loaded_heads, family: str, k: int) -> None:
    model, tokenizer, head, _ = loaded_heads[family]

    @settings(max_examples=3, deadline=None)
    @given(prompt=prompts, data=st.data())
    def check(prompt: list[int], data: st.DataObject) -> None:
        full = reference(model, prompt, N)
        i = data.draw(st.integers(0, N - 2), label="stop at")
        size = data.draw(st.integers(1, 2), label="stop length")
        stop = [full[i : i + size]]
        want, reason = cut_at_stop(full, stop, set(tokenizer.eos_token_ids))
        got = list(
            mtp_stream_generate(model, tokenizer, prompt, head, N, num_draft_tokens=k, stop_sequences=stop)
        )
        assert got[-1].finish_reason == reason
        tokens = [r.token for r in got]
        assert (tokens[:-1] if reason == "stop" else tokens) == want
        assert "".join(r.text for r in got) == streamed_text(tokenizer, want)

    check()


def test_eos_ends_like_stream_generate(loaded_heads) -> None:
    """An EOS token ends both streams the same way (not detokenized, finish 'stop')."""
    model, tokenizer, head, _ = loaded_heads["mimo"]
    prompt = [72, 105]
    full = reference(model, prompt, N)
    tokenizer.eos_token_ids = {full[4]}  # pretend the fifth token is EOS
    try:
        want = list(stream_generate(model, tokenizer, prompt, max_tokens=N))
        got = list(mtp_stream_generate(model, tokenizer, prompt, head, N, num_draft_tokens=2))
    finally:
        tokenizer.eos_token_ids = {256}
    assert want[-1].finish_reason == "stop"
    assert [_fields(r) for r in got] == [_fields(r) for r in want]
