"""A sequence that ends by length hands back caches holding exactly what it was given.

mlx-lm's `generate_step` leaves the caller's cache holding the prompt and every token but
the last; `BatchGenerator` hands a finished row's cache back with `all_tokens` naming
exactly what it holds. A cycle can accept more drafts than the request has room for: the
row keeps at most `remaining - 1` of them (RowPlan.keep), so no token the caller never
saw stays in a cache a server reuses. A head that drafts mlx-lm's own continuation
accepts every draft, and N = 14 leaves one token for the last cycle at k = 1, 2 and 3.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.runtime.acceptance import cap_accepted
from melix_mlx.runtime.engine import CycleEngine
from melix_mlx.runtime.engine_records import RowPlan
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.runtime.sampling import SamplingParams
from melix_mlx.tools.tiny import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from scripted_head import ScriptedHead

N = 14
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def _perfect_head(model, prompts: list[list[int]], n: int) -> ScriptedHead:
    scripts = [p + reference(model, p, n + 4) for p in prompts]
    return ScriptedHead(scripts, VOCAB_SIZE, main_parts(model).args.hidden_size)


def _fed(model, tokens: list[int]) -> list:
    """A single-sequence cache fed `tokens` (prefill, then the last token on its own)."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens[:-1])[None], cache=cache)
    model(mx.array(tokens[-1:])[None], cache=cache)
    return cache


def _assert_holds(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        if isinstance(w, ArraysCache):
            for a, b in zip(g.cache, w.cache):
                assert np.allclose(np.array(a), np.array(b), atol=1e-4)
        else:
            assert g.offset == w.offset
            n = w.offset
            for a, b in ((g.keys, w.keys), (g.values, w.values)):
                assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-4)


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_cache_holds_the_prompt_and_every_token_but_the_last(
    loaded_heads, family: str, k: int, run_ahead: bool
) -> None:
    model = loaded_heads[family][0]
    cache = make_prompt_cache(model)
    got, decoder = mtp(
        model, _perfect_head(model, [PROMPT], N), PROMPT, N, k, run_ahead=run_ahead, prompt_cache=cache
    )
    assert got == reference(model, PROMPT, N)
    assert decoder.stats["accepted"] > 0 and decoder.stats["faults"] == 0
    _assert_holds(cache, _fed(model, PROMPT + got[:-1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_finished_row_cache_and_all_tokens_name_what_it_emitted(loaded_heads, family: str) -> None:
    model = loaded_heads[family][0]
    prompts = [PROMPT, [100, 3, 8]]
    gen = MTPBatchGenerator(model, _perfect_head(model, prompts, N), num_draft_tokens=2)
    uids = gen.insert(prompts, max_tokens=[N, N - 1])
    emitted: dict[int, list[int]] = {uid: [] for uid in uids}
    finished = {}
    drafted = 0
    while gen.batch.uids or gen._queue:
        for r in gen.next()[1]:
            emitted[r.uid].append(r.token)
            drafted += r.from_draft
            if r.finish_reason is not None:
                finished[r.uid] = r
    for uid, prompt in zip(uids, prompts):
        done = finished[uid]
        assert done.finish_reason == "length"
        assert emitted[uid] == reference(model, prompt, len(emitted[uid]))
        assert done.all_tokens == prompt + emitted[uid][:-1]
        _assert_holds(done.prompt_cache, _fed(model, done.all_tokens))
    assert drafted > 0


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_a_draft_past_the_cap_becomes_the_last_token(temp: float) -> None:
    """Both acceptance rules: a target that agrees with every draft accepts both, but a row
    allowed to keep one keeps the first and ends on the second (the target's own token
    there, greedy or accepted by the speculative rule) instead of the bonus after it."""
    V, drafts = 16, mx.array([[3, 7]], mx.uint32)
    peaked = mx.full((1, 3, V), -1e4).at[0, mx.arange(3), mx.array([3, 7, 11])].add(1e4)
    logprobs = peaked - mx.logsumexp(peaked, axis=-1, keepdims=True)
    q = [[mx.zeros((1, V)).at[0, t].add(1.0)] for t in (3, 7)]  # each draft drawn for sure
    params = SamplingParams(temp=temp)
    sampler = None if temp == 0 else (lambda lp: mx.random.categorical(lp))
    for keep, want in ((None, (2, 11)), (1, (1, 7)), (0, (0, 3))):
        plan = RowPlan(2, params, sampler, remaining=None if keep is None else keep + 1)
        assert plan.keep == keep
        accepted, bonus = CycleEngine._accept(None, [plan], [2], 2, drafts, q, logprobs)
        emitted, kept, last = cap_accepted([plan], [2], 2, drafts, accepted, bonus)
        assert accepted.item() == 2  # the rule accepted both ...
        assert emitted.item() == min(2, want[0] + 1)  # ... the row emits what it keeps, then one
        assert (kept.item(), last.item()) == want
