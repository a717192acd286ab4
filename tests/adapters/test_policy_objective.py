"""What a batched step is worth to the live policy (MTPBatchGenerator `objective`).

Every emitted token counts, priced at some batch's plain step. A fixed batch nobody
refills ends with its longest row, and plain would run every row to that end together,
so "drain" prices a token at the batch size the drain started from, also on the tail of
steps where fewer rows are left; "throughput" prices it at the step's own size (right
while requests wait for rows); "auto" is drain with an empty queue and throughput
otherwise. Here one row's drafts are scripted right (it races ahead and leaves) and the
other's are wrong (it advances one token a step), so the drain has a tail at batch 1.
Tokens stay mlx-lm's.
"""

from __future__ import annotations

import pytest
from decode_refs import reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from scripted_head import ScriptedHead

FAST, SLOW = [5, 17, 33, 2, 9, 41, 7], [100, 3, 8]
N = 12


class RecordingController:
    """Always speculates at depth 2; records what each step was said to be worth."""

    speculating, k, disabled = True, 2, False

    def __init__(self) -> None:
        self.events: list = []
        self.steps: list[tuple[int, int, int | None]] = []  # (batch size, tokens, priced at)

    def update(self, batch_size, accepted=0, proposed=0, *, tokens=None, priced_at=None, **_):
        self.steps.append((batch_size, tokens, priced_at))

    def summary(self) -> dict:
        return {"steps": len(self.steps)}


def _generator(loaded_heads, objective: str, **slots) -> tuple[MTPBatchGenerator, RecordingController]:
    model = loaded_heads["mimo"][0]
    script = FAST + reference(model, FAST, N + 4)
    head = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size)
    controller = RecordingController()
    kw = {} if objective == "default" else {"objective": objective}
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, controller=controller, **slots, **kw)
    return gen, controller


def _drive(gen: MTPBatchGenerator, controller: RecordingController, prompts) -> tuple[list, list, list]:
    """(the steps the controller was fed, tokens each step emitted, whether a request
    waited for a row when the step began) for one greedy run of `prompts` to their end."""
    uids = gen.insert(list(prompts), max_tokens=[N] * len(prompts))
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    steps, emitted_per_step, waiting = [], [], []
    while gen.batch.uids or gen._queue:
        before = len(controller.steps)
        queued = bool(gen._queue)
        generated = gen.next_generated()
        stepped = 0
        for r in generated:
            joined = not tokens[r.uid]  # a row's first token comes from its prefill, not a step
            tokens[r.uid].append(r.token)
            stepped += not joined
        if len(controller.steps) > before:
            steps += controller.steps[before:]
            emitted_per_step.append(stepped)
            waiting.append(queued)
    assert [tokens[u] for u in uids] == [reference(gen.model, p, N) for p in prompts]
    return steps, emitted_per_step, waiting


def _run(loaded_heads, objective: str, prompts=(FAST, SLOW), **slots):
    return _drive(*_generator(loaded_heads, objective, **slots), prompts)


def test_drain_prices_every_token_at_the_batch_it_started_from(loaded_heads) -> None:
    steps, emitted, _ = _run(loaded_heads, "drain")
    assert [tokens for _, tokens, _ in steps] == emitted  # every token counts ...
    assert {priced for _, _, priced in steps} == {2}  # ... at the two-row batch's plain price
    assert steps[0][0] == 2 and steps[-1][0] == 1  # also on the tail, after the fast row left
    # sharp: the fast row's drafts are accepted, so some step emits more than one token a row
    assert any(tokens > size for size, tokens, _ in steps)


def test_a_new_batch_after_a_drain_is_priced_at_its_own_size(loaded_heads) -> None:
    gen, controller = _generator(loaded_heads, "drain")
    first, _, _ = _drive(gen, controller, (FAST, SLOW))
    assert {priced for _, _, priced in first} == {2}
    alone, _, _ = _drive(gen, controller, (SLOW,))  # the same generator, one row this time
    assert alone and {(size, priced) for size, _, priced in alone} == {(1, 1)}


def test_throughput_prices_tokens_at_the_steps_own_batch(loaded_heads) -> None:
    steps, emitted, _ = _run(loaded_heads, "throughput")
    assert [tokens for _, tokens, _ in steps] == emitted and sum(emitted) == 2 * (N - 1)
    assert all(priced is None for _, _, priced in steps)  # None: the step's own batch size


def test_auto_drains_a_fixed_batch_and_counts_tokens_while_requests_wait(loaded_heads) -> None:
    assert _run(loaded_heads, "default")[0] == _run(loaded_heads, "drain")[0]  # nothing waits
    # three requests, two rows: the third waits until the fast row is done, then nothing waits
    prompts, slots = (FAST, SLOW, FAST), {"completion_batch_size": 2, "prefill_batch_size": 2}
    steps, _, waiting = _run(loaded_heads, "default", prompts, **slots)
    throughput, _, _ = _run(loaded_heads, "throughput", prompts, **slots)
    drain, _, _ = _run(loaded_heads, "drain", prompts, **slots)
    assert True in waiting and False in waiting
    for step, waited, counted, drained in zip(steps, waiting, throughput, drain, strict=True):
        assert step == (counted if waited else drained)
    # sharp: in both phases the two objectives price some step differently
    assert any(t != d for t, d, w in zip(throughput, drain, waiting) if w)
    assert any(t != d for t, d, w in zip(throughput, drain, waiting) if not w)


def test_an_unknown_objective_is_refused(loaded_heads) -> None:
    with pytest.raises(ValueError, match="objective must be one of"):
        MTPBatchGenerator(loaded_heads["mimo"][0], None, objective="latency")
