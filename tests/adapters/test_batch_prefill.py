"""Joining rows prefilled together (melix_mlx.runtime.prefill.prefill_together, batch_prompts.prepare_rows).

What holds: one joint prefill of prompts of different lengths (1 token included) gives
every row the hidden states, last logits and cache that prefilling it alone gives (to
float32 rounding: the batched matmuls may sum in another order), for every family; the
generator prefills fresh requests together and a request with an inserted cache alone,
and its tokens equal mlx-lm's greedy decode either way; with rotating caches
(`max_kv_size`) its tokens equal mlx-lm's `BatchGenerator`'s.
"""

from __future__ import annotations

from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_mlx.batch_generator import MTPBatchGenerator  # noqa: E402
from melix_mlx.decoding.batch_prompts import join_groups  # noqa: E402
from melix_mlx.decoding.batch_rows import InsertRequest  # noqa: E402
from melix_mlx.runtime import rollback  # noqa: E402
from melix_mlx.runtime.prefill import prefill_together, prefill_with_hidden  # noqa: E402
from melix_mlx.tools.tiny import FAMILIES  # noqa: E402
from mlx_lm.generate import BatchGenerator, StopSequences, _merge_caches, generate_step  # noqa: E402
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 11], [100], [7, 8], [12, 13, 14, 15, 16]]
TOLERANCE = 1e-4


def _live(cache: Any) -> list[mx.array]:
    """A row cache's contents: recurrent states, or the keys and values it holds."""
    if isinstance(cache, ArraysCache):
        return [a for a in cache.cache if a is not None]
    keys, values = cache.state[:2]
    return [keys[..., : cache.offset, :], values[..., : cache.offset, :]]


def _drain(gen: MTPBatchGenerator) -> dict[int, list[int]]:
    """Run the generator until every request has finished (bounded); tokens per uid."""
    out: dict[int, list[int]] = {}
    for _ in range(200):
        if not (gen.batch.uids or gen._queue):
            return out
        for r in gen.next()[1]:
            out.setdefault(r.uid, []).append(r.token)
    raise AssertionError("the generator did not finish")


def _worst(a: list[mx.array], b: list[mx.array]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((mx.abs(x - y).max().item() for x, y in zip(a, b)), default=0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_prefilled_together_equal_each_prefilled_alone(loaded_heads, family: str) -> None:
    model = loaded_heads[family][0]
    cache = _merge_caches([make_prompt_cache(model) for _ in PROMPTS])
    logits, hiddens = prefill_together(model, PROMPTS, cache, step_size=4)  # chunked, padded
    assert logits.shape[0] == len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        alone = make_prompt_cache(model)
        last, h = prefill_with_hidden(model, mx.array(prompt), alone, step_size=4)
        assert hiddens[i].shape == h.shape
        assert mx.abs(hiddens[i] - h).max().item() < TOLERANCE, (family, i)
        assert mx.abs(logits[i] - last[0]).max().item() < TOLERANCE, (family, i)
        assert int(mx.argmax(logits[i])) == int(mx.argmax(last[0]))
        row = [c.extract(i) for c in cache]
        joint, own = rollback.leaves(row), rollback.leaves(alone)
        assert [type(c) for c in joint] == [type(c) for c in own]
        for x, y in zip(joint, own):
            if not isinstance(y, ArraysCache):
                assert x.offset == y.offset == len(prompt)
            assert _worst(_live(x), _live(y)) < TOLERANCE, (family, i)


def test_prefill_together_refuses_an_empty_prompt(loaded_heads) -> None:
    model = loaded_heads["qwen3_5"][0]
    with pytest.raises(ValueError, match="none empty"):
        prefill_together(model, [[1, 2], []], _merge_caches([make_prompt_cache(model) for _ in range(2)]))


def test_join_groups_bound_the_padding_and_keep_every_request_once() -> None:
    lengths = [442, 423, 454, 657, 429, 512, 698, 476, 3]
    requests = [_request(uid, n) for uid, n in enumerate(lengths)]
    groups = join_groups(requests, max_padding=0.25)
    assert sorted(r.uid for g in groups for r in g) == list(range(len(lengths)))
    assert [[len(r.prompt) for r in g] for g in groups] == [
        [3],
        [423, 429, 442, 454, 476, 512],
        [657, 698],
    ]
    for g in groups:
        real = sum(len(r.prompt) for r in g)
        assert len(g) * max(len(r.prompt) for r in g) - real <= 0.25 * real
    assert [len(g) for g in join_groups(requests, max_padding=0.0)] == [1] * len(lengths)
    assert join_groups([]) == []


def _request(uid: int, n: int) -> InsertRequest:
    return InsertRequest(uid, [1] * n, 8, None, [], None, (), StopSequences(), 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_generator_prefills_fresh_requests_together_and_a_cached_one_alone(
    loaded_heads, family: str, monkeypatch
) -> None:
    import melix_mlx.decoding.batch_admission as bg  # where admission calls the prefill

    model, _, head, _ = loaded_heads[family]
    n = 12
    prompts = [PROMPTS[0], [100, 3, 8], [7, 8, 9, 10], [12, 13, 14, 15]]  # 3 fresh of like length
    refs = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=n)] for p in prompts]
    joint: list[int] = []
    alone: list[int] = []
    together, single = bg.prepare_rows, bg.prepare_row

    def spy_together(model_: Any, head_: Any, engine: Any, requests: list, **kw: Any) -> Any:
        joint.append(len(requests))
        return together(model_, head_, engine, requests, **kw)

    def spy_single(model_: Any, head_: Any, engine: Any, request: Any, **kw: Any) -> Any:
        alone.append(request.uid)
        return single(model_, head_, engine, request, **kw)

    monkeypatch.setattr(bg, "prepare_rows", spy_together)
    monkeypatch.setattr(bg, "prepare_row", spy_single)
    # the first prompt's first 4 tokens are already cached: it continues from that cache
    cached = make_prompt_cache(model)
    prefill_with_hidden(model, mx.array(PROMPTS[0][:4]), cached)
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, max_tokens=n)
    uids = gen.insert(
        [PROMPTS[0][4:], *prompts[1:]],
        caches=[cached, None, None, None],
        all_tokens=[PROMPTS[0][:4], [], [], []],
    )
    out = _drain(gen)
    assert joint == [3] and alone == [uids[0]]
    assert [out[u] for u in uids] == refs
    assert gen.speculative_stats()["cycles"] > 0


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
def test_rotating_caches_decode_as_mlx_lm_batch_generator(loaded_heads, family: str, monkeypatch) -> None:
    """`max_kv_size` (a refused batch decodes plainly), prompts longer than the window,
    inserted together: the tokens equal mlx-lm's `BatchGenerator`'s. Prefilled one by one
    they did not (its batch caches window a padded joint prefill differently from one
    row's cache): mimo's rows then differed from their first or second token on. With
    windowed caches every fresh prompt joins one group, however unlike their lengths."""
    import melix_mlx.decoding.batch_admission as bg  # where admission calls the prefill

    model, _, head, _ = loaded_heads[family]
    long = [(7 * i) % 200 + 1 for i in range(24)]  # unlike length: joined anyway, as mlx-lm joins
    prompts = [[5, 17, 33, 2, 9, 41, 7, 3, 11, 12, 13], [100, 3, 8, 9, 10, 11, 12, 13, 14], PROMPTS[0], long]
    n = 10
    reference = BatchGenerator(model, max_kv_size=8)
    ref_uids = reference.insert(prompts, max_tokens=[n] * len(prompts))
    want: dict[int, list[int]] = {}
    while responses := reference.next_generated():
        for r in responses:
            want.setdefault(r.uid, []).append(r.token)
    reference.close()
    joint: list[int] = []
    together = bg.prepare_rows
    monkeypatch.setattr(bg, "prepare_rows", lambda *a, **kw: joint.append(len(a[3])) or together(*a, **kw))
    gen = MTPBatchGenerator(model, head, max_kv_size=8, max_tokens=n)
    uids = gen.insert(prompts)
    out = _drain(gen)
    gen.close()
    windowed = any(isinstance(c, RotatingKVCache) for c in rollback.leaves(make_prompt_cache(model, 8)))
    assert windowed == (family == "mimo")  # qwen3_5's own caches ignore max_kv_size
    assert joint == ([4] if windowed else [3])  # unwindowed: the long prompt goes alone
    assert [out[u] for u in uids] == [want[u] for u in ref_uids]
