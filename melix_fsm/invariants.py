"""Checkers for the batch invariants named in spec/batch.toml.

Rules of this module:
- One checker per invariant name in the spec; a test asserts the two sets match.
- State checkers look at one batch; relational checkers compare a batch with a
  `Snapshot` taken before an operation. Both raise `InvariantViolation` naming the
  invariant and the row, and never change the batch.
- Used by this project's stateful suites, by the conformance kit, and by generators
  that want to assert their own batch after each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .batch import Batch
from .counters import Counters, total
from .errors import MelixError, UnknownSequence
from .lifecycle import FINISH, IN_CYCLE, State
from .lifecycle import SPEC as LIFECYCLE_SPEC
from .spec import load_batch

BATCH_SPEC = load_batch(LIFECYCLE_SPEC)
_IN_CYCLE = IN_CYCLE


class InvariantViolation(MelixError, AssertionError):
    """A batch invariant of spec/batch.toml does not hold."""

    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        self.detail = detail
        super().__init__(f"invariant {invariant!r} violated: {detail}")


@dataclass(frozen=True)
class Snapshot:
    """What a batch looked like: uids in order, and each row's state, counters, payload id."""

    uids: tuple[Any, ...]
    states: dict[Any, State]
    counters: dict[Any, Counters]
    payload_ids: dict[Any, int]
    totals: Counters

    @classmethod
    def of(cls, batch: Batch) -> Snapshot:
        return cls(
            uids=tuple(batch.uids),
            states={row.uid: row.state for row in batch},
            counters={row.uid: row.counters.copy() for row in batch},
            payload_ids={row.uid: id(row.payload) for row in batch},
            totals=batch.totals(),
        )


def check_unique_uids(batch: Batch) -> None:
    uids = batch.uids
    if len(set(uids)) != len(uids):
        raise InvariantViolation("unique_uids", f"duplicate uids in {uids}")


def check_pending_only_in_cycle(batch: Batch) -> None:
    for row in batch:
        in_cycle = row.state in _IN_CYCLE
        if in_cycle != (row.counters.pending > 0):
            raise InvariantViolation(
                "pending_only_in_cycle",
                f"row {row.uid!r} in {row.state.value} has {row.counters.pending} pending drafts",
            )


def _balance(uid: Any, c: Counters) -> None:
    if c.proposed != c.accepted + c.rejected + c.discarded + c.pending:
        raise InvariantViolation(
            "counters_balance",
            f"row {uid!r}: proposed {c.proposed} != accepted {c.accepted} + rejected "
            f"{c.rejected} + discarded {c.discarded} + pending {c.pending}",
        )
    if c.emitted != c.plain_steps + c.accepted + c.cycles:
        raise InvariantViolation(
            "counters_balance",
            f"row {uid!r}: emitted {c.emitted} != plain {c.plain_steps} + accepted "
            f"{c.accepted} + cycles {c.cycles}",
        )


def check_counters_balance(batch: Batch) -> None:
    for row in batch:
        _balance(row.uid, row.counters)


def check_position_counts(batch: Batch) -> None:
    for row in batch:
        c = row.counters
        pp, pa = c.position_proposed, c.position_accepted
        if len(pa) > len(pp) or any(a > p for a, p in zip(pa, pp)):
            raise InvariantViolation("position_counts", f"row {row.uid!r}: {pa} vs {pp}")
        if any(pa[i + 1] > pa[i] for i in range(len(pa) - 1)):
            raise InvariantViolation("position_counts", f"row {row.uid!r}: {pa} not decreasing")
        if sum(pa) != c.accepted or sum(pp) != c.proposed:
            raise InvariantViolation(
                "position_counts", f"row {row.uid!r}: position sums do not match the totals"
            )


def check_totals_include_retired(batch: Batch) -> None:
    live = total([row.counters for row in batch])
    live.add(batch.retired)
    if live != batch.totals():
        raise InvariantViolation("totals_include_retired", "totals differ from live + retired")


STATE_CHECKS: dict[str, Callable[[Batch], None]] = {
    "unique_uids": check_unique_uids,
    "pending_only_in_cycle": check_pending_only_in_cycle,
    "counters_balance": check_counters_balance,
    "position_counts": check_position_counts,
    "totals_include_retired": check_totals_include_retired,
}


# -- relational checks: a batch against a snapshot taken before an operation ----------


def check_order_preserved(before: Snapshot, batch: Batch) -> None:
    """Survivors keep their relative order; new rows come after every survivor."""
    old_pos = {uid: i for i, uid in enumerate(before.uids)}
    survivors = [uid for uid in batch.uids if uid in old_pos]
    if survivors != sorted(survivors, key=old_pos.__getitem__):
        raise InvariantViolation("order_preserved", f"survivors reordered: {survivors}")
    seen_new = False
    for uid in batch.uids:
        if uid not in old_pos:
            seen_new = True
        elif seen_new:
            raise InvariantViolation("order_preserved", f"row {uid!r} moved after a new row")


def check_survivors_unchanged(before: Snapshot, batch: Batch) -> None:
    """After extend/filter, every surviving row has its old state, counters and payload."""
    for row in batch:
        uid = row.uid
        if uid not in before.states:
            continue
        if row.state != before.states[uid]:
            raise InvariantViolation("survivors_unchanged", f"row {uid!r} changed state")
        if row.counters != before.counters[uid]:
            raise InvariantViolation("survivors_unchanged", f"row {uid!r} changed counters")
        if id(row.payload) != before.payload_ids[uid]:
            raise InvariantViolation("survivors_unchanged", f"row {uid!r} lost its payload")


def check_atomic_step(before: Snapshot, batch: Batch) -> None:
    """After a refused operation, nothing changed at all."""
    if tuple(batch.uids) != before.uids:
        raise InvariantViolation("atomic_step", "rows changed after a refused operation")
    for row in batch:
        if row.state != before.states[row.uid] or row.counters != before.counters[row.uid]:
            raise InvariantViolation("atomic_step", f"row {row.uid!r} changed after a refusal")


def check_removed_uids_rejected(batch: Batch, removed: list[Any]) -> None:
    """Every uid that left the batch is refused with UnknownSequence."""
    before = Snapshot.of(batch)
    for uid in removed:
        if uid in batch:
            continue  # the uid was reused by a later extend: not a removed uid any more
        try:
            batch.step({uid: FINISH})
        except UnknownSequence:
            continue
        raise InvariantViolation("removed_uids_rejected", f"uid {uid!r} was accepted")
    check_atomic_step(before, batch)


RELATIONAL_CHECKS: dict[str, Callable[..., None]] = {
    "order_preserved": check_order_preserved,
    "survivors_unchanged": check_survivors_unchanged,
    "atomic_step": check_atomic_step,
    "removed_uids_rejected": check_removed_uids_rejected,
}

_declared = set(BATCH_SPEC.invariants)
_checked = set(STATE_CHECKS) | set(RELATIONAL_CHECKS)
if _declared != _checked:
    raise RuntimeError(f"invariants without a checker or spec entry: {_declared ^ _checked}")


def check_batch(batch: Batch) -> None:
    """Run every state invariant on `batch`."""
    for check in STATE_CHECKS.values():
        check(batch)


def check_reshape(before: Snapshot, batch: Batch) -> None:
    """Run the invariants that must hold after extend or filter."""
    check_order_preserved(before, batch)
    check_survivors_unchanged(before, batch)
    check_batch(batch)
