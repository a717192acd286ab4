"""Deliberately broken MTPBatchGenerators: each plants one real-world bug for the kit to catch.

Rules of this file:
- Each class is a small subclass of melix_mlx's MTPBatchGenerator that changes one
  private step and keeps the rest, so the only difference from the real generator is
  the planted bug. Each reports honestly through `last_report` what it actually did:
  the kit must catch the bug from its outcomes, not from a confession.
- The bugs are the ones speculative batching gets wrong in practice: per-row state lost
  on a reshape, a rollback applied to the wrong row, drafts streamed before their
  verify, rows reordered on join; and the classic cycle errors the divergence contract
  must still call bugs in every dtype (`CYCLE_BUGS`): one draft more accepted than
  matched, a survivor's last token read at its old row index after a filter, and a
  rollback applied to the wrong row.
"""

from __future__ import annotations

from typing import Any

import melix_mlx.batch_generator as bg
import melix_mlx.runtime.engine as engine_mod
import mlx.core as mx
from melix_mlx.batch_generator import MTPBatchGenerator, MTPResponse

from melix_fsm.lifecycle import SequenceMachine, State


def _forget_heads(generator: MTPBatchGenerator) -> None:
    """Lose every row's head state (next draft, head hidden, pending pairs)."""
    for head in generator.engine.rows:
        head.draft = head.q = head.hidden = None
        head.pending_h, head.pending_t = [], []


class DropsStateOnFilter(MTPBatchGenerator):
    """filter() rebuilds every surviving row's speculative state from scratch.

    The naive "re-admit after a reshape" pattern: the head state is dropped and each
    survivor gets a fresh lifecycle machine (admitted, zero counters).
    """

    def _filter(self, keep: list[int]) -> None:
        super()._filter(keep)
        _forget_heads(self)
        for row in self.batch:
            state: bg.RowState = row.payload
            fresh = State("admitted") if state.refusal is None else State("refused")
            row.machine = SequenceMachine(row.uid, fresh)


class DropsHeadPairsOnFilter(MTPBatchGenerator):
    """filter() drops the surviving rows' head state (next draft, pending pairs) and nothing else.

    Tokens stay exact (verification guards them); the next cycle then has no draft to
    verify and raises: inside a head forward a fault, elsewhere in the cycle an engine error
    that surfaces as itself.
    """

    def _filter(self, keep: list[int]) -> None:
        super()._filter(keep)
        _forget_heads(self)


class RollsBackWrongRow(MTPBatchGenerator):
    """Per-row rollback uses the next row's kept length (an off-by-one in the row index)."""

    def _step(self) -> list[MTPResponse]:
        original = engine_mod.rollback.drop_row_suffixes

        def shifted(cache: list[Any], drop: Any, **kw: Any) -> None:
            if kw.get("skip_recurrent"):  # the main cache's rollback (in the graph: a device array)
                drop = mx.roll(drop, -1) if isinstance(drop, mx.array) else drop[1:] + drop[:1]
            return original(cache, drop, **kw)

        engine_mod.rollback.drop_row_suffixes = shifted  # the module global settle calls; restored below
        try:
            return super()._step()
        finally:
            engine_mod.rollback.drop_row_suffixes = original


class EmitsDraftsBeforeVerify(MTPBatchGenerator):
    """Streams each draft to the caller as soon as the head proposes it ("optimistic" output).

    After the verify only the token after the accepted prefix is new, so an all-accepted
    cycle looks right; a rejected draft has already reached the caller.
    """

    def _conclude(self, rows: Any, states: Any, plans: Any, settled: Any) -> list[MTPResponse]:
        streamed = {rows[i].uid: list(settled.drafts[i]) for i, p in enumerate(plans) if p.k > 0}
        early = [
            MTPResponse(uid, d, mx.zeros((1,)), None, None, None, True)
            for uid, sent in streamed.items()
            for d in sent
        ]
        out = super()._conclude(rows, states, plans, settled)
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
            self.engine.filter(perm)
            rows = list(self.batch.rows)
            self.batch._rows = [rows[i] for i in perm]
            self.batch._index = {row.uid: i for i, row in enumerate(self.batch._rows)}
        return responses


class AcceptsOneTooMany(MTPBatchGenerator):
    """Acceptance off by one: one draft more than matched is accepted (up to the row's k)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        original = self.engine._accept

        def one_more(plans: Any, ks: Any, K: int, *rest: Any) -> Any:
            accepted, bonus = original(plans, ks, K, *rest)
            return mx.minimum(accepted + 1, mx.array(ks, dtype=accepted.dtype)), bonus

        self.engine._accept = one_more  # the instance's own: the engine calls self._accept


class StaleRowAfterFilter(MTPBatchGenerator):
    """After rows leave, each survivor's last token is read at its old row index."""

    def _filter(self, keep: list[int]) -> None:
        before = self.engine.y
        super()._filter(keep)
        if keep and keep != list(range(len(keep))):
            self.engine.y = before[: len(keep)]


BROKEN = {
    "drops_state_on_filter": DropsStateOnFilter,
    "drops_head_pairs_on_filter": DropsHeadPairsOnFilter,
    "rolls_back_wrong_row": RollsBackWrongRow,
    "emits_drafts_before_verify": EmitsDraftsBeforeVerify,
    "reorders_on_extend": ReordersOnExtend,
}
CYCLE_BUGS = {
    "off_by_one_acceptance": AcceptsOneTooMany,
    "stale_row_after_filter": StaleRowAfterFilter,
    "wrong_rollback": RollsBackWrongRow,
}
