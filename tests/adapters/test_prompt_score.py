"""A sampled start is priced at the acceptance its prompts score, not the greedy prior.

The score (melix_mlx.runtime.prompt_score) is checked against an independent reference:
mlx-lm's own forward over the prompt for the target, the head called whole over every
prompt pair for the drafts, the slots aligned by the token they draft. Then the decoders:
the controller receives exactly that figure before the first step and takes the first
decision again on it (LiveController.price_prompts), single-sequence and batched.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from melix_mlx.decoding.batch_generator import MTPBatchGenerator
from melix_mlx.decoding.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime import prompt_score
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.runtime.prefill import prefill_with_hidden
from melix_mlx.runtime.sampling import SamplingParams, make_sampler, normalize_logits, probabilities
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.cost_model import AcceptancePrior, Timings
from melix_fsm.policy.live_types import LiveReason
from melix_fsm.policy.modes import Mode

TEMP = 0.7
# A k = 1 cycle costs 1.7 plain steps: the prior (0.95) admits it (1.95 / 1.7), an
# acceptance below 0.7 does not. The trained head scores ~0.4 per draft at T = 0.7.
TIMINGS = Timings(t_1=1.0, t_verify=1.6, t_head=0.1, k=1, batch_size=1)
HIGH_PRIOR = AcceptancePrior(name="high", acceptance=0.95)


@pytest.fixture(scope="module")
def trained() -> tuple:
    model, tokenizer, head, _ = load_with_heads(resolve_model("stdlib-hybrid"))
    return model, tokenizer, head


def prompts(tokenizer) -> list[list[int]]:
    texts = [
        "def parse_args(argv):\n    parser = argparse.ArgumentParser(description='Copy files')\n"
        "    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args(argv)\n",
        "The module provides a way of using operating system dependent functionality. If you "
        "just want to read or write a file see open(), if you want to manipulate paths, see ",
    ]
    return [tokenizer.encode(t) for t in texts]


def reference_score(
    model, head, prompt: list[int], first: int, params: SamplingParams, slots: int = prompt_score.SLOTS
) -> float:
    """Slot j of the head drafts t_{j+2}; the model's logits at position j + 1 predict it."""
    n = len(prompt)
    target_logits = model(mx.array(prompt)[None])[0]  # [n, V]: position i predicts t_{i+1}
    _, hiddens = forward_with_hidden(model, mx.array(prompt)[None], make_prompt_cache(model))
    drafts, _ = head(hiddens, mx.array([*prompt[1:], first])[None], head.make_cache())  # [1, n, V]
    m = min(slots, n - 1)
    total = 0.0
    for j in range(n - 1 - m, n - 1):
        p = probabilities(normalize_logits(target_logits[j + 1]), params)
        q = probabilities(normalize_logits(drafts[0, j]), params)
        total += mx.minimum(p, q).sum().item()
    return total / m


def controller(**kw) -> LiveController:
    return LiveController(TIMINGS, prior=HIGH_PRIOR, policy="auto", depth=1, **kw)


def test_the_score_is_the_overlap_at_the_slots_the_prompt_can_check(trained) -> None:
    model, tokenizer, head = trained
    params = SamplingParams(temp=TEMP, top_p=0.95)
    engine = MTPDecoder(model, head).engine
    prompt = prompts(tokenizer)[0]
    n = len(prompt)
    for step_size in (2048, 60):  # whole, and in chunks: only the last chunk's slots are scored
        logits, hiddens = prefill_with_hidden(model, mx.array(prompt), make_prompt_cache(model), step_size)
        first = int(mx.argmax(logits, axis=-1).item())
        row = engine.prime(head.make_cache(), hiddens, [*prompt[1:], first], params, step_size, score=True)
        last_chunk = n - step_size * ((n - 1) // step_size)
        slots = min(prompt_score.SLOTS, last_chunk - 1)
        assert row.prompt_acceptance is not None and slots > 0
        want = reference_score(model, head, prompt, first, params, slots)
        got = row.prompt_acceptance.item()
        assert abs(got - want) < 2e-3, (step_size, slots, got, want)
        assert 0.05 < want < 0.95  # a trained head, sampled: neither trivial end


def test_greedy_rows_and_unasked_primes_score_nothing(trained) -> None:
    model, tokenizer, head = trained
    prompt = prompts(tokenizer)[0]
    engine = MTPDecoder(model, head).engine
    for params, score in ((SamplingParams(), True), (SamplingParams(temp=TEMP), False)):
        _, hiddens = forward_with_hidden(model, mx.array(prompt)[None], make_prompt_cache(model))
        row = engine.prime(head.make_cache(), hiddens[0], [*prompt[1:], 0], params, 2048, score)
        assert row.prompt_acceptance is None


def test_a_sampled_start_the_prompt_disproves_begins_suspended(trained) -> None:
    model, tokenizer, head = trained
    prompt = prompts(tokenizer)[0]
    ctrl = controller()
    assert ctrl.state is Mode.on  # the prior alone admits it
    mx.random.seed(3)
    decoder = MTPDecoder(model, head, num_draft_tokens=1, sampler=make_sampler(TEMP), controller=ctrl)
    tokens = [t for t, _, _ in decoder.generate(mx.array(prompt), 12)]
    assert len(tokens) == 12
    assert ctrl.prompt_acceptance is not None and ctrl.prompt_acceptance < 0.7
    first = ctrl.events[0]
    assert (first.step, first.reason) == (0, LiveReason.prompt_acceptance)
    assert decoder.stats["proposed"] == 0  # no cycle ran: suspended from the first step
    assert decoder.stats["policy"]["prompt_acceptance"] == ctrl.prompt_acceptance


def test_a_greedy_start_keeps_the_prior(trained) -> None:
    model, tokenizer, head = trained
    ctrl = controller()
    decoder = MTPDecoder(model, head, num_draft_tokens=1, controller=ctrl)
    list(decoder.generate(mx.array(prompts(tokenizer)[0]), 6))
    assert ctrl.prompt_acceptance is None and decoder.stats["proposed"] > 0


def test_a_batch_is_priced_at_its_rows_mean_greedy_rows_at_the_prior(trained) -> None:
    model, tokenizer, head = trained
    ps = prompts(tokenizer)
    ctrl = controller(batch_size=2)
    gen = MTPBatchGenerator(model, head, num_draft_tokens=1, max_tokens=4, controller=ctrl)
    gen.insert(ps, samplers=[make_sampler(TEMP), None])  # one sampled row, one greedy
    gen.next()
    # the last pair (the one holding the first token) drafts past the prompt and is not
    # scored; the head is causal, so the reference needs no first token
    sampled = reference_score(model, head, ps[0], 0, SamplingParams(temp=TEMP))
    assert ctrl.prompt_acceptance == pytest.approx((sampled + HIGH_PRIOR.acceptance) / 2, abs=2e-3)
    while gen.next_generated():
        pass
    assert ctrl.step > 0
