"""Per-row behaviour of the batched generator: rollback isolation and mixed batches.

- Rollback isolation: rows that accept everything, nothing, or a varying prefix share
  every step; afterwards each row's cache equals a clean single-sequence run over the
  same tokens, and its head acceptance shows its head cache was primed and caught up.
- Mixed batches: different draft counts, samplers (greedy, tagged temperature sampler,
  an opaque custom sampler that must be refused), logits processors, a head fault, and
  controller-driven suspend / resume, all in one batch, with each greedy row equal to its
  own mlx-lm reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.runtime.sampling import make_sampler
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from scripted_head import ScriptedHead  # tests/adapters is on sys.path (rootdir-relative imports)

from melix_fsm import invariants
from melix_fsm.lifecycle import Event, State
from melix_fsm.policy.live_types import Action

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [7, 8, 9, 10, 11, 12, 13, 14]]
MAX_TOKENS = 24


def _reference(model, prompt, max_tokens=MAX_TOKENS, **kw) -> list[int]:
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, **kw)]


def _drain(gen: MTPBatchGenerator, check=None) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(500):
        if not (gen.batch.uids or gen._queue):
            break
        _, responses = gen.next()
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
        invariants.check_batch(gen.batch)
        if check is not None:
            check(gen)
    return out


def _clean_cache(model, tokens: list[int]) -> list:
    """A single-sequence cache fed `tokens` the way mlx-lm's generate_step feeds them."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens[:-1])[None], cache=cache)
    model(mx.array(tokens[-1:])[None], cache=cache)
    return cache


def _assert_cache_equal(got: list, want: list, atol: float) -> None:
    for g, w in zip(got, want):
        if isinstance(w, ArraysCache):
            for a, b in zip(g.cache, w.cache):
                assert np.allclose(np.array(a), np.array(b), atol=atol)
        else:
            assert g.offset == w.offset
            n = w.offset
            for a, b in ((g.keys, w.keys), (g.values, w.values)):
                assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=atol)


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3", "qwen3_5"])
def test_rows_with_different_acceptance_roll_back_in_isolation(family, loaded_heads):
    model, _, _, _ = loaded_heads[family]
    refs = [_reference(model, p) for p in PROMPTS]
    # Row 0 is scripted exactly, row 1 is scripted wrong every third position, row 2 not at all.
    head = ScriptedHead(
        [PROMPTS[0] + refs[0], PROMPTS[1] + refs[1]],
        vocab_size=model.args.vocab_size if hasattr(model.args, "vocab_size") else 259,
        hidden_size=64,
        wrong_every=None,
    )
    wrong = ScriptedHead([PROMPTS[1] + refs[1]], 259, 64, wrong_every=3)
    original_predict = head.predict
    row1_prefix = tuple(PROMPTS[1][1:])

    def predict(prefix):  # row 1 gets the deliberately wrong script
        if tuple(prefix[: len(row1_prefix)]) == row1_prefix:
            return wrong.predict(prefix)
        return original_predict(prefix)

    head.predict = predict
    gen = MTPBatchGenerator(model, head, num_draft_tokens=3, max_tokens=MAX_TOKENS + 10)
    uids = gen.insert(PROMPTS, max_tokens=[MAX_TOKENS] * 3)
    early: dict[int, list[int]] = {uid: [] for uid in uids}
    for _ in range(4):  # several verify steps with all three rows alive
        for r in gen.next()[1]:
            early[r.uid].append(r.token)
    assert gen.batch.uids == uids
    # the public surface: a cycle running ahead is undone before the caches are read
    extracted = gen.extract_cache(set(uids))
    for row in gen.batch:
        cache, context = extracted[row.uid]
        assert context == row.payload.context
        _assert_cache_equal(cache, _clean_cache(model, context), atol=1e-4)
    rates = [row.counters.acceptance_rate for row in gen.batch]
    assert rates[0] == 1.0  # primed and caught up: a perfect script accepts everything
    assert 0.0 < rates[1] < 1.0
    assert rates[2] == 0.0
    got = _drain(gen)
    for uid, ref in zip(uids, refs):
        assert early[uid] + got.get(uid, []) == ref


def test_mixed_batch_samplers_processors_and_draft_counts(loaded_heads):
    model, _, head, _ = loaded_heads["mimo"]
    penalty = make_logits_processors(repetition_penalty=1.3)
    bias = mx.zeros((259,)).at[7].add(0.5)

    def custom_sampler(logprobs):  # opaque: its distribution cannot be known
        return mx.argmax(logprobs + bias, axis=-1)

    gen = MTPBatchGenerator(model, head, max_tokens=MAX_TOKENS)
    uids = gen.insert(
        PROMPTS + [[42, 43]],
        samplers=[None, custom_sampler, None, make_sampler(temp=0.8, top_k=20)],
        logits_processors=[[], [], penalty, []],
        num_draft_tokens=[1, 2, 3, 2],
    )
    first = {r.uid: [r.token] for r in gen.next()[1]}
    report = gen.last_report
    assert report.joined == uids
    resolved = {r.uid: r.events[0].event for r in report.rows}
    assert resolved[uids[1]] is Event("refuse")
    assert [resolved[u] for u in (uids[0], uids[2], uids[3])] == [Event("admit")] * 3
    got = {uid: first.get(uid, []) + tokens for uid, tokens in _drain(gen).items()}
    assert got[uids[0]] == _reference(model, PROMPTS[0])
    assert got[uids[1]] == _reference(model, PROMPTS[1], sampler=custom_sampler)
    assert got[uids[2]] == _reference(model, PROMPTS[2], logits_processors=penalty)
    assert len(got[uids[3]]) == MAX_TOKENS
    totals = gen.batch.totals()
    assert totals.plain_steps == MAX_TOKENS - 1  # the refused row decoded plainly


def test_head_fault_rows_continue_plainly_without_losing_tokens(loaded_heads):
    model, _, head, _ = loaded_heads["deepseek_v3"]
    calls = {"n": 0}

    class FlakyHead:
        def make_cache(self):
            return head.make_cache()

        def __call__(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("head exploded")
            return head(*args, **kwargs)

    gen = MTPBatchGenerator(model, FlakyHead(), num_draft_tokens=2, max_tokens=MAX_TOKENS)
    uids = gen.insert(PROMPTS[:2])
    got = _drain(gen)
    for uid, prompt in zip(uids, PROMPTS):
        assert got[uid] == _reference(model, prompt)
    totals = gen.batch.totals()
    assert totals.faults == 2
    assert totals.plain_steps > 0


class _ScriptedController:
    """Duck-typed controller: suspends at step 2, resumes at step 5."""

    def __init__(self):
        self.step = 0
        self.events = []
        self.speculating = True

    def update(self, batch_size, accepted=0, proposed=0, **timing):
        self.step += 1
        action = {2: Action.suspend, 5: Action.resume}.get(self.step, Action.keep)
        if action is not Action.keep:
            self.speculating = action is Action.resume
        return action

    def summary(self):
        return {"steps": self.step}


def test_controller_suspends_and_resumes_rows_through_lifecycle_events(loaded_heads):
    model, _, head, _ = loaded_heads["mimo"]
    gen = MTPBatchGenerator(
        model, head, num_draft_tokens=2, max_tokens=MAX_TOKENS, controller=_ScriptedController()
    )
    uids = gen.insert(PROMPTS[:2])
    states = []
    got = _drain(gen, check=lambda g: states.append({r.state for r in g.batch}))
    assert {State("suspended")} in states
    for uid, prompt in zip(uids, PROMPTS):
        assert got[uid] == _reference(model, prompt)
    totals = gen.batch.totals()
    assert totals.suspensions == 2 and totals.resumptions == 2
    # three plain steps per row, and the plain step already running ahead when the verdict
    # resumed: kept as the window's last step, not undone
    assert totals.suspended_steps == 2 * (3 + 1)
    assert gen.speculative_stats()["abandoned_steps"] == 0


def test_plain_steps_run_ahead_through_removal_and_joins(loaded_heads):
    """Plain steps launched ahead (as mlx-lm's generator does) survive remove, insert and
    prompt-cache extraction: tokens stay mlx-lm's, an extracted cache holds exactly the
    tokens it is returned with."""
    from melix_fsm.policy.controller import LiveController
    from melix_fsm.policy.decision import Policy

    model, _, head, _ = loaded_heads["qwen3_5"]
    off = LiveController(None, policy=Policy.force_off)
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, max_tokens=MAX_TOKENS, controller=off)
    uids = gen.insert(PROMPTS[:2])
    got: dict[int, list[int]] = {uid: [] for uid in uids}
    for _ in range(4):
        for r in gen.next()[1]:
            got[r.uid].append(r.token)
    assert gen.steps.ahead is not None  # the next plain step is already running
    caches = gen.remove([uids[0]], return_prompt_caches=True)
    cache, tokens = caches[uids[0]]
    assert tokens[: len(PROMPTS[0])] == PROMPTS[0]
    assert all(c.offset == len(tokens) for c in cache if hasattr(c, "offset"))
    assert tokens[len(PROMPTS[0]) :] == _reference(model, PROMPTS[0])[: len(tokens) - len(PROMPTS[0])]
    (late,) = gen.insert([PROMPTS[2]])
    got[late] = []
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
    assert got[uids[1]] == _reference(model, PROMPTS[1])
    assert got[late] == _reference(model, PROMPTS[2])
    assert gen.speculative_stats()["proposed"] == 0
