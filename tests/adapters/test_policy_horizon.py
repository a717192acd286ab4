"""Decoders tell the live controller how much of the run is left (`remaining`).

A scheduled probe starts only while the run can still pay for it
(melix_fsm.policy.controller, `probe_min_remaining`), so what the decoders pass must be
the truth: what is left of `max_tokens` after each step for one sequence; the longest
budget left in a batch nobody refills; None while requests wait for a row.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.decode import MTPDecoder

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [11, 12, 13, 14]]
N = 12


class HorizonController:
    """Speculates at depth 2 throughout and records each step's `remaining` and tokens."""

    speculating = True
    k = 2
    disabled = False
    plain_due = False

    def __init__(self) -> None:
        self.seen: list[tuple[int | None, int | None]] = []
        self.events: list = []

    def update(self, batch_size, accepted=0, proposed=0, *, tokens=None, remaining=None, **timing):
        self.seen.append((remaining, tokens))

    def summary(self) -> dict:
        return {"steps": len(self.seen)}


@pytest.mark.parametrize("run_ahead", [False, True])
def test_single_sequence_passes_what_is_left_of_max_tokens(loaded_heads, run_ahead) -> None:
    model, _, head, _ = loaded_heads["mimo"]
    controller = HorizonController()
    decoder = MTPDecoder(model, head, num_draft_tokens=2, controller=controller, run_ahead=run_ahead)
    tokens = list(decoder.generate(mx.array(PROMPTS[0]), N))
    assert len(tokens) == N and decoder.stats["proposed"] > 0
    assert len(controller.seen) >= N // 3  # every step was fed
    emitted = list(itertools.accumulate(t for _, t in controller.seen))
    # the first token comes from the prompt's forward; each step then spends its tokens
    assert [r for r, _ in controller.seen] == [max(N - 1 - e, 0) for e in emitted]
    assert controller.seen[-1][0] == 0


def test_a_draining_batch_passes_its_longest_budget(loaded_heads) -> None:
    model, _, head, _ = loaded_heads["mimo"]
    controller = HorizonController()
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, max_tokens=N, controller=controller)
    budgets = dict(zip(gen.insert(PROMPTS[:2], max_tokens=[N, N - 4]), [N, N - 4]))
    checked = 0
    while True:
        fed = len(controller.seen)
        _, generation = gen.next()
        for r in generation:
            budgets[r.uid] -= 1
            if r.finish_reason is not None:
                budgets[r.uid] = 0
        if len(controller.seen) > fed:  # a decode step: the batch's longest budget left
            assert controller.seen[-1][0] == max(budgets.values())
            checked += 1
        if not generation and not len(gen.batch):
            break
    assert checked >= N // 3 and controller.seen[-1][0] == 0


def test_rows_waiting_for_a_slot_mean_no_end_in_sight(loaded_heads) -> None:
    """With one row slot and requests queued, each step's batch will be refilled: the
    controller hears None until the last request holds the only row."""
    model, _, head, _ = loaded_heads["mimo"]
    controller = HorizonController()
    slots = {"completion_batch_size": 1, "prefill_batch_size": 1}
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, max_tokens=N, controller=controller, **slots)
    gen.insert(PROMPTS)
    while gen.next_generated():
        pass
    remaining = [r for r, _ in controller.seen]
    waiting = list(itertools.takewhile(lambda r: r is None, remaining))
    assert waiting and len(waiting) < len(remaining)
    last_row = remaining[len(waiting) :]
    assert None not in last_row and last_row[-1] == 0
    assert last_row == sorted(last_row, reverse=True)
