"""Deliberately broken MTPBatchGenerators: each plants one real-world bug for the kit to catch.

Rules of this file:
- Each class is a small subclass of melix_mlx's MTPBatchGenerator that changes one
  private step and keeps the rest, so the only difference from the real generator is
  the planted bug. Each reports honestly through `last_report` what it actually did:
  the kit must catch the bug from its outcomes, not from a confession.
- The bugs are the ones speculative batching gets wrong in practice: per-row state lost
  on a reshape, a rollback applied to the wrong row, drafts streamed before their
  verify, rows reordered on join.
"""

from __future__ import annotations

from typing import Any

import melix_mlx.batch_generator as bg
import mlx.core as mx
from melix_mlx.batch_generator import MTPBatchGenerator, MTPResponse

from melix_fsm.lifecycle import SequenceMachine, State


class DropsStateOnFilter(MTPBatchGenerator):
    """filter() rebuilds every surviving row's speculative state from scratch.

    The naive "re-admit after a reshape" pattern: the pending head pairs are dropped and
    each survivor gets a fresh lifecycle machine (admitted, zero counters).
    """

    def _filter(self, keep: list[int]) -> None:
        super()._filter(keep)
        for row in self.batch:
            state: bg.RowState = row.payload
            state.pending_hidden, state.pending_tokens = None, []
            fresh = State("admitted") if state.refusal is None else State("refused")
            row.machine = SequenceMachine(row.uid, fresh)


class DropsHeadPairsOnFilter(MTPBatchGenerator):
    """filter() drops the surviving rows' pending head pairs and nothing else.

    Tokens stay exact (verification guards them); the head then drafts from a hole, and
    when the row is drafting alone the head forward raises on the missing pairs: the
    generator swallows that as a fault.
    """

    def _filter(self, keep: list[int]) -> None:
        super()._filter(keep)
        for row in self.batch:
            row.payload.pending_hidden, row.payload.pending_tokens = None, []


class RollsBackWrongRow(MTPBatchGenerator):
    """Per-row rollback uses the next row's kept length (an off-by-one in the row index)."""

    def _verify(self, *args: Any) -> list[MTPResponse]:
        original = bg.rollback_rows

        def shifted(cache: list[Any], checkpoint: Any, fed: int, keep: list[int]) -> bool:
            return original(cache, checkpoint, fed, keep[1:] + keep[:1])

        bg.rollback_rows = shifted  # the module global _verify calls; restored below
        try:
            return super()._verify(*args)
        finally:
            bg.rollback_rows = original


class EmitsDraftsBeforeVerify(MTPBatchGenerator):
    """Streams each draft to the caller as soon as the head proposes it ("optimistic" output).

    After the verify only the token after the accepted prefix is new, so an all-accepted
    cycle looks right; a rejected draft has already reached the caller.
    """

    def _verify(
        self,
        rows: tuple[Any, ...],
        states: list[Any],
        spec: list[int],
        k_rows: list[int],
        K: int,
        drafts: mx.array | None,
        qs: list[Any],
    ) -> list[MTPResponse]:
        proposed = drafts.tolist() if drafts is not None else []  # [B, K]; row i's are its first k_rows[i]
        streamed = {rows[i].uid: [int(d) for d in proposed[i][: k_rows[i]]] for i in spec}
        early = [
            MTPResponse(uid, d, mx.zeros((1,)), None, None, None, True)
            for uid, sent in streamed.items()
            for d in sent
        ]
        out = super()._verify(rows, states, spec, k_rows, K, drafts, qs)
        late = [r for r in out if not (r.from_draft and r.uid in streamed)]  # already sent
        for uid, sent in streamed.items():
            self._emitted[uid] = list(sent) + [r.token for r in late if r.uid == uid]
        return early + late


class ReordersOnExtend(MTPBatchGenerator):
    """Joining rows are placed before the existing rows (caches and batch alike).

    Every row still sees its own cache row, so tokens stay exact: only the row order,
    which the contract fixes (survivors keep their order, joiners are appended), is wrong.
    """

    def _admit(self, out: list[MTPResponse]) -> list[Any]:
        responses = super()._admit(out)
        n = len(self.batch)
        j = sum(1 for uid in self._joined if uid in self.batch)
        if 0 < j < n:
            perm = list(range(n - j, n)) + list(range(n - j))
            for c in self.cache + self.head_cache:
                c.filter(perm)
            rows = list(self.batch.rows)
            self.batch._rows = [rows[i] for i in perm]
            self.batch._index = {row.uid: i for i, row in enumerate(self.batch._rows)}
        return responses


BROKEN = {
    "drops_state_on_filter": DropsStateOnFilter,
    "drops_head_pairs_on_filter": DropsHeadPairsOnFilter,
    "rolls_back_wrong_row": RollsBackWrongRow,
    "emits_drafts_before_verify": EmitsDraftsBeforeVerify,
    "reorders_on_extend": ReordersOnExtend,
}
