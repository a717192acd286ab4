"""MTPBatchGenerator's server-facing surface (melix_mlx.decoding.batch_surface) on the embedded checkpoint.

insert_segments (tokens equal to `insert` and to mlx-lm's generator; one boundary per call,
with an immutable cache copy at exactly that boundary), prompt caches in and out (a
finished row's cache continues a conversation exactly as mlx-lm's generator does), close
restoring the wired limit, prompt_cache_nbytes, stats, and a failing prefill dropping only
its own request. The server tests (test_serve*.py) drive mlx-lm's own server loop with it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_mlx.batch_generator import MTPBatchGenerator  # noqa: E402
from melix_mlx.decoding import batch_surface  # noqa: E402
from melix_mlx.decoding.batch_surface import RequestFailed  # noqa: E402
from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
TEXTS = ["The king of the north", "Once upon a time there was", "In the morning the sun"]
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any, Any]:
    from melix_mlx.loading import load_with_heads

    model, tokenizer, head, _ = load_with_heads(CKPT)
    return model, tokenizer, head


@pytest.fixture(scope="module")
def prompts(loaded: tuple) -> list[list[int]]:
    return [loaded[1].encode(t) for t in TEXTS]


def drain(gen: Any, uids: list[int], on_prompt: Any = None) -> dict[int, list[int]]:
    """Run to completion (bounded); tokens per uid."""
    out: dict[int, list[int]] = {u: [] for u in uids}
    finished: dict[int, Any] = {}
    for _ in range(10_000):
        if len(finished) == len(uids):
            break
        prompt_responses, generation = gen.next()
        if on_prompt is not None:
            on_prompt(gen, prompt_responses)
        for r in generation:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r
    else:
        raise AssertionError("the generator did not finish")
    drain.finished = finished  # type: ignore[attr-defined]
    return out


def segments_of(prompt: list[int]) -> list[list[int]]:
    return [prompt[:2], prompt[2:4], prompt[4:]]


def test_insert_segments_equals_insert_and_mlx_lm(loaded: tuple, prompts: list) -> None:
    model, _, head = loaded
    plain = MTPBatchGenerator(model, head, num_draft_tokens=2)
    expected = drain(plain, plain.insert(prompts, max_tokens=[20] * 3))
    ref = BatchGenerator(model)
    theirs = drain(ref, ref.insert_segments([segments_of(p) for p in prompts], max_tokens=[20] * 3))
    boundaries: list[tuple[int, tuple, int, list[int]]] = []

    def on_prompt(gen: Any, responses: list) -> None:
        seen = [r.uid for r in responses if r.end_of_segment and not r.end_of_prompt]
        assert len(seen) == len(set(seen))  # one boundary per request per call
        for uid, (cache, tokens) in gen.extract_cache(seen).items():
            progress = next(r.progress for r in responses if r.uid == uid and not r.end_of_prompt)
            boundaries.append((uid, progress, cache[0].offset, tokens))

    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    uids = gen.insert_segments([segments_of(p) for p in prompts], max_tokens=[20] * 3)
    ours = drain(gen, uids, on_prompt)
    assert list(ours.values()) == list(expected.values()) == list(theirs.values())
    assert sorted((u, p[0], off, len(t)) for u, p, off, t in boundaries) == sorted(
        (u, n, n, n) for u in uids for n in (2, 4)
    )
    for uid, _, offset, tokens in boundaries:
        assert tokens == prompts[uids.index(uid)][:offset]


def test_boundary_cache_is_a_copy(loaded: tuple, prompts: list) -> None:
    model, _, head = loaded
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    (uid,) = gen.insert_segments([segments_of(prompts[0])], max_tokens=[8])
    kept = []

    def keep(g: Any, responses: list) -> None:
        boundary = [r.uid for r in responses if r.end_of_segment and not r.end_of_prompt]
        kept.extend(g.extract_cache(boundary).values())

    drain(gen, [uid], keep)
    assert [c[0].offset for c, _ in kept] == [2, 4]  # unchanged by the prefill that went on


def test_prompt_cache_in_and_out_matches_mlx_lm(loaded: tuple, prompts: list) -> None:
    model, tokenizer, head = loaded
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    (uid,) = gen.insert([prompts[0]], max_tokens=[12])
    drain(gen, [uid])
    done = drain.finished[uid]  # type: ignore[attr-defined]
    cache, history = done.prompt_cache, done.all_tokens
    assert cache[0].offset == len(history)  # the cache holds exactly the tokens it names
    follow = tokenizer.encode(" and then")
    ours_gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    (a,) = ours_gen.insert([follow], max_tokens=[16], caches=[copy.deepcopy(cache)], all_tokens=[history])
    ref = BatchGenerator(model)
    (b,) = ref.insert([follow], max_tokens=[16], caches=[copy.deepcopy(cache)], all_tokens=[history])
    assert drain(ours_gen, [a])[a] == drain(ref, [b])[b]


def test_close_restores_the_wired_limit(loaded: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, head = loaded
    calls = []
    monkeypatch.setattr(batch_surface, "maybe_set_recommended_wired_limit", lambda: 1234)
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    gen = MTPBatchGenerator(model, head)
    gen.close()
    gen.close()
    assert calls == [1234]  # restored once, to the limit found at construction


def test_prompt_cache_nbytes_and_stats(loaded: tuple, prompts: list) -> None:
    model, _, head = loaded
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    assert gen.prompt_cache_nbytes == 0
    with gen.stats() as stats:
        uids = gen.insert(prompts, max_tokens=[6] * 3)
        _, first = gen.next()
        assert gen.prompt_cache_nbytes > 0
        tokens = drain(gen, uids)
    assert stats.prompt_tokens == sum(map(len, prompts))
    # every generated token counts, the prefill's first ones too (as mlx-lm's generator counts them)
    assert stats.generation_tokens == len(first) + sum(map(len, tokens.values()))


def test_a_failing_prefill_drops_only_its_request(loaded: tuple, prompts: list, monkeypatch) -> None:
    import melix_mlx.decoding.batch_admission as bg  # where admission calls the prefill

    model, _, head = loaded
    ref = MTPBatchGenerator(model, head, num_draft_tokens=2)
    expected = drain(ref, ref.insert(prompts, max_tokens=[10] * 3))
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    uids = gen.insert(prompts, max_tokens=[10] * 3)
    prefill, together = bg.prepare_row, bg.prepare_rows
    joint: list[list[int]] = []

    def failing(model_: Any, head_: Any, engine: Any, request: Any, **kw: Any) -> Any:
        if request.uid == uids[1]:
            raise RuntimeError("injected prefill failure")
        return prefill(model_, head_, engine, request, **kw)

    def failing_together(model_: Any, head_: Any, engine: Any, requests: list, **kw: Any) -> Any:
        joint.append([r.uid for r in requests])
        if any(r.uid == uids[1] for r in requests):
            raise RuntimeError("injected prefill failure")
        return together(model_, head_, engine, requests, **kw)

    monkeypatch.setattr(bg, "prepare_row", failing)
    monkeypatch.setattr(bg, "prepare_rows", failing_together)
    with pytest.raises(RequestFailed) as info:
        gen.next()
    assert set(info.value.failures) == {uids[1]}
    assert [sorted(group) for group in joint] == [sorted(uids)]  # together first, then one by one
    first = list(info.value.responses[1])
    rest = drain(gen, [uids[0], uids[2]])
    for uid in (uids[0], uids[2]):
        assert [r.token for r in first if r.uid == uid] + rest[uid] == expected[uid]
    assert uids[1] not in gen.batch


def test_a_row_ready_before_a_joint_prefill_fails_draws_its_first_token_once(loaded, prompts) -> None:
    """Three fresh requests of one length join one prefill, and the second one's sampler
    raises. The first row, made ready before the failure, keeps the first token its
    sampler drew; the rest are prefilled one by one; only the failing request leaves. So
    every surviving row's sampler ran as often as if its request had joined alone."""
    model, _, head = loaded
    calls = [0, 0, 0]

    def sampler_for(i: int) -> Any:
        def sample(logprobs: Any) -> Any:
            calls[i] += 1
            if i == 1:
                raise RuntimeError("injected sampler failure")
            return mx.argmax(logprobs, axis=-1)

        return sample

    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    uids = gen.insert([prompts[0]] * 3, max_tokens=[4] * 3, samplers=[sampler_for(i) for i in range(3)])
    with pytest.raises(RequestFailed) as info:
        gen.next()
    assert set(info.value.failures) == {uids[1]}
    assert calls[0] == calls[2] >= 1 and uids[0] in gen.batch and uids[2] in gen.batch


def test_rebind_fails_loudly_when_mlx_lm_changes() -> None:
    from melix_mlx.serve.runtime import rebind
    from mlx_lm.server import ResponseGenerator

    with pytest.raises(RuntimeError, match="no longer uses"):
        rebind(ResponseGenerator._generate, NotAnMlxLmName=object())
    assert rebind(ResponseGenerator._generate, BatchGenerator=object()) is not ResponseGenerator._generate


def test_a_fully_cached_prompt_feeds_its_last_token_again(loaded: tuple, prompts: list) -> None:
    model, _, head = loaded
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2)
    (uid,) = gen.insert([prompts[0]], max_tokens=[8])
    drain(gen, [uid])
    done = drain.finished[uid]  # type: ignore[attr-defined]
    cache, history = done.prompt_cache, done.all_tokens
    before = list(history)
    ours = MTPBatchGenerator(model, head, num_draft_tokens=2)
    (a,) = ours.insert_segments([[]], max_tokens=[12], caches=[copy.deepcopy(cache)], all_tokens=[history])
    trimmed = copy.deepcopy(cache)
    for c in trimmed:
        c.trim(1)
    ref = BatchGenerator(model)
    (b,) = ref.insert([history[-1:]], max_tokens=[12], caches=[trimmed], all_tokens=[history[:-1]])
    assert drain(ours, [a])[a] == drain(ref, [b])[b]
    assert history == before  # the caller's token list is not modified


def test_plain_rows_pipeline_while_requests_queue_for_a_row(loaded: tuple, prompts: list) -> None:
    """mlx-lm launches the next plain step before reading this one's tokens even while
    requests wait for a row, and so do we: a queue with no free row does not stop the
    step running ahead. Same tokens as mlx-lm's generator, also where rows leave on a
    stop token while a step runs ahead (their row goes to the queue one call later)."""
    from melix_fsm.policy.controller import LiveController
    from melix_fsm.policy.decision import Policy

    model, _, head = loaded
    many = prompts * 3
    slots = {"completion_batch_size": 2, "prefill_batch_size": 2}
    free = BatchGenerator(model, **slots)
    unstopped = drain(free, free.insert(many, max_tokens=[12] * len(many)))
    stop = next(iter(unstopped.values()))[4]  # a token some row emits mid-run
    ref = BatchGenerator(model, stop_tokens=[[stop]], **slots)
    theirs = drain(ref, ref.insert(many, max_tokens=[12] * len(many)))
    gen = MTPBatchGenerator(
        model, head, controller=LiveController(None, policy=Policy.force_off), stop_tokens=[[stop]], **slots
    )
    waiting_ahead = 0

    def count(g: Any, _: list) -> None:
        nonlocal waiting_ahead
        waiting_ahead += bool(g._queue) and len(g.batch) == 2 and g.steps.ahead is not None

    ours = drain(gen, gen.insert(many, max_tokens=[12] * len(many)), count)
    assert list(ours.values()) == list(theirs.values())
    assert any(len(t) < 12 for t in ours.values())  # some rows left on the stop token
    assert waiting_ahead > 0
