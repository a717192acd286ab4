"""What a batched step is worth to the live policy (MTPBatchGenerator `objective`).

A fixed batch nobody refills ends with its longest row, so "drain" judges a step by the
batch's progress to that end (B x the drop in the largest budget left); "throughput"
counts every emitted token (right while requests wait for rows); "auto" is drain with an
empty queue and throughput otherwise. Here one row's drafts are scripted right (it races
ahead) and the other's are wrong (it advances one token a step): under drain the fast
row's extra tokens are worth nothing, under throughput they count. Tokens stay mlx-lm's.
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
        self.steps: list[tuple[int, int]] = []  # (batch size, tokens)

    def update(self, batch_size, accepted=0, proposed=0, *, tokens=None, **_):
        self.steps.append((batch_size, tokens))

    def summary(self) -> dict:
        return {"steps": len(self.steps)}


def _run(loaded_heads, objective: str, prompts=(FAST, SLOW), **slots):
    """(the steps the controller was fed, tokens each step emitted, whether a request
    waited for a row when the step began) for one greedy run."""
    model = loaded_heads["mimo"][0]
    script = FAST + reference(model, FAST, N + 4)
    head = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size)
    controller = RecordingController()
    kw = {} if objective == "default" else {"objective": objective}
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, controller=controller, **slots, **kw)
    uids = gen.insert(list(prompts), max_tokens=[N] * len(prompts))
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    emitted_per_step, waiting = [], []
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
            emitted_per_step.append(stepped)
            waiting.append(queued)
    assert [tokens[u] for u in uids] == [reference(model, p, N) for p in prompts]
    return controller.steps, emitted_per_step, waiting


def test_drain_counts_the_longest_rows_progress(loaded_heads) -> None:
    steps, emitted, _ = _run(loaded_heads, "drain")
    # the slow row has the longest budget left: one token a step, until that budget is
    # used up (each row's first token comes from its prefill, not a step)
    assert sum(tokens / size for size, tokens in steps) == N - 1
    assert any(e > tokens for (_, tokens), e in zip(steps, emitted))  # the fast row's extra: not counted


def test_throughput_counts_every_token(loaded_heads) -> None:
    steps, emitted, _ = _run(loaded_heads, "throughput")
    assert [tokens for _, tokens in steps] == emitted and sum(emitted) == 2 * (N - 1)


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
    # sharp: in both phases some step is worth a different amount under the other objective
    assert any(t != d for t, d, w in zip(throughput, drain, waiting) if w)
    assert any(t != d for t, d, w in zip(throughput, drain, waiting) if not w)


def test_an_unknown_objective_is_refused(loaded_heads) -> None:
    with pytest.raises(ValueError, match="objective must be one of"):
        MTPBatchGenerator(loaded_heads["mimo"][0], None, objective="latency")
