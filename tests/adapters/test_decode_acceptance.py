"""The acceptance path, driven by a scripted head (tests/adapters/scripted_head.py).

A head that drafts exactly mlx-lm's greedy continuation must be accepted on (nearly)
every cycle: that only happens when the decoder primes the head cache from the prompt
and catches it up after every verify, and trims the chained draft entries. A head that
is deliberately wrong at known positions forces partial acceptance and rollbacks, and
the output must still equal mlx-lm's, for every cache kind (qwen3_5 selects its
recurrent layers' state captured inside the verify, the others trim; nothing replays).
The head cache holds exactly confirmed pairs: a prefix of mlx-lm's continuation (the last
cycle keeps no draft past `max_tokens`: test_cache_handback.py).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.tools.tiny import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.sample_utils import make_logits_processors
from scripted_head import ScriptedHead

N = 30
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def _head(model, script: list[int], wrong_every: int | None = None) -> ScriptedHead:
    return ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=wrong_every)


def _head_tokens(decoder) -> list[int]:
    """The token ids the scripted head's cache holds (what it was fed, net of trims)."""
    c = decoder.head_cache[0]
    return c.keys[0, 0, : c.offset, 0].astype(mx.int32).tolist()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_perfect_script_is_always_accepted(loaded_heads, family: str, k: int) -> None:
    model = loaded_heads[family][0]
    longer = reference(model, PROMPT, N + k + 1)
    want = longer[:N]
    got, decoder = mtp(model, _head(model, PROMPT + longer), PROMPT, N, k)
    stats = decoder.stats
    assert got == want
    assert stats["acceptance_rate"] >= 0.95
    assert stats["rollbacks"] == 0 and stats["replay_forwards"] == 0
    # every verify emits k + 1 tokens: N - 1 tokens after the prefill's first one
    assert stats["target_forwards"] <= -(-(N - 1) // (k + 1)) + 1
    assert stats["per_position_acceptance"] == [1.0] * k
    # the head cache holds exactly the confirmed tokens t_1.. (primed, caught up, trimmed)
    held = _head_tokens(decoder)
    assert held == (PROMPT + longer)[1 : 1 + len(held)] and len(held) >= len(PROMPT) + N - 2 * (k + 1)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_drafts_roll_back_exactly(loaded_heads, family: str, k: int) -> None:
    model = loaded_heads[family][0]
    longer = reference(model, PROMPT, N + k + 1)
    want = longer[:N]
    got, decoder = mtp(model, _head(model, PROMPT + longer, wrong_every=3), PROMPT, N, k)
    stats = decoder.stats
    assert got == want
    assert stats["accepted"] > 0 and stats["rejected"] > 0 and stats["rollbacks"] > 0
    assert 0 < stats["acceptance_rate"] < 1
    held = _head_tokens(decoder)
    assert held == (PROMPT + longer)[1 : 1 + len(held)] and len(held) >= len(PROMPT) + N - 2 * (k + 1)
    assert stats["replay_forwards"] == 0  # recurrent layers select captured states


@pytest.mark.parametrize("family", FAMILIES)
def test_acceptance_with_repetition_penalty(loaded_heads, family: str) -> None:
    model = loaded_heads[family][0]
    procs = make_logits_processors(repetition_penalty=1.3)
    want = reference(model, PROMPT, N, logits_processors=procs)
    script = PROMPT + want
    got, decoder = mtp(model, _head(model, script), PROMPT, N, 2, logits_processors=procs)
    assert got == want and decoder.stats["acceptance_rate"] >= 0.95
    got, decoder = mtp(model, _head(model, script, wrong_every=4), PROMPT, N, 3, logits_processors=procs)
    assert got == want and decoder.stats["rollbacks"] > 0
