"""Unit tests of melix_fsm.batch.Batch and of the invariant checkers.

Rules of this file:
- Every refused operation is checked for "nothing changed" with a Snapshot and the
  atomic_step checker, not just for the error type.
- Each invariant named in spec/batch.toml has a checker, and each checker is shown to
  fail on a deliberately corrupted batch: a checker that cannot fail proves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from melix_fsm.batch import OPERATION_EVENTS, Batch, Row, operation_for
from melix_fsm.counters import Counters, total
from melix_fsm.errors import (
    BatchShapeError,
    DuplicateSequence,
    EventNotInOperation,
    IllegalTransition,
    InvalidEvent,
    LifecycleError,
    UnknownSequence,
)
from melix_fsm.invariants import (
    BATCH_SPEC,
    RELATIONAL_CHECKS,
    STATE_CHECKS,
    InvariantViolation,
    Snapshot,
    check_atomic_step,
    check_batch,
    check_removed_uids_rejected,
    check_reshape,
)
from melix_fsm.lifecycle import (
    ADMIT,
    FAULT,
    FINISH,
    PLAIN_STEP,
    REFUSE,
    RESUME,
    SUSPEND,
    VERIFY,
    SequenceMachine,
    State,
    draft,
    verified,
)

S = State


def cycle(batch: Batch, uid: Any, k: int, a: int) -> None:
    batch.step({uid: [draft(k), VERIFY, verified(a)]})


def admitted_batch(uids: list[Any], payloads: list[Any] | None = None) -> Batch:
    batch = Batch()
    batch.extend(uids, payloads)
    batch.resolve({uid: ADMIT for uid in uids})
    return batch


def refused(batch: Batch, op: Callable[[], Any], error: type[LifecycleError]) -> LifecycleError:
    """Run a refused operation; assert its error type and that nothing changed."""
    before = Snapshot.of(batch)
    retired = total([batch.retired])
    with pytest.raises(error) as info:
        op()
    check_atomic_step(before, batch)
    assert {row.uid: id(row.payload) for row in batch} == before.payload_ids
    assert batch.retired == retired
    check_batch(batch)
    return info.value


# -- extend --------------------------------------------------------------------------------


def test_extend_with_uids_appends_in_order() -> None:
    batch = Batch(["a", "b"])
    payloads = [object(), object()]
    before = Snapshot.of(batch)
    batch.extend(["c", "d"], payloads)
    assert batch.uids == ["a", "b", "c", "d"]
    assert [batch.index(u) for u in batch.uids] == [0, 1, 2, 3]
    assert all(row.state == S("requested") and row.counters == Counters() for row in batch)
    assert batch.row("c").payload is payloads[0] and batch.row("d").payload is payloads[1]
    check_reshape(before, batch)


def test_extend_payload_count_mismatch() -> None:
    batch = Batch(["a"])
    refused(batch, lambda: batch.extend(["b", "c"], [None]), BatchShapeError)


def test_extend_with_batch_moves_rows_with_payload() -> None:
    batch = admitted_batch(["a"])
    other = admitted_batch(["x", "y"], payloads=[{"p": 1}, {"p": 2}])
    cycle(other, "x", 3, 1)
    other.step({"y": draft(2)})
    moved = {row.uid: (row.machine, row.counters, row.payload) for row in other}
    before = Snapshot.of(batch)
    batch.extend(other)
    check_reshape(before, batch)
    assert batch.uids == ["a", "x", "y"]
    for uid, (machine, counters, payload) in moved.items():
        row = batch.row(uid)
        assert row.machine is machine and row.counters is counters and row.payload is payload
    assert batch.state("x") == S("rolled_back") and batch.state("y") == S("drafting")
    assert len(other) == 0 and "x" not in other  # the source keeps no aliases
    check_batch(batch)


def test_extend_duplicate_uid() -> None:
    batch = Batch(["a", "b"])
    err = refused(batch, lambda: batch.extend(["c", "a"]), DuplicateSequence)
    assert err.uid == "a"  # type: ignore[attr-defined]
    refused(batch, lambda: batch.extend(["c", "c"]), DuplicateSequence)
    other = Batch(["z", "b"])
    refused(batch, lambda: batch.extend(other), DuplicateSequence)
    assert other.uids == ["z", "b"]  # a refused move leaves the source intact too


# -- filter --------------------------------------------------------------------------------


def test_filter_keeps_strictly_increasing_rows() -> None:
    payloads = [object() for _ in range(5)]
    batch = admitted_batch(list("abcde"), payloads)
    cycle(batch, "b", 2, 2)
    before = Snapshot.of(batch)
    batch.filter([0, 1, 3])
    check_reshape(before, batch)
    assert batch.uids == ["a", "b", "d"]
    assert batch.row("d").payload is payloads[3]
    assert batch.retired_uids == ["c", "e"]
    batch.filter([])
    assert len(batch) == 0 and batch.retired_uids == list("ceabd")


@pytest.mark.parametrize(
    "keep",
    [[1, 0], [0, 0], [0, 2, 1], [5], [-1], [0, 3, 9], [True], ["0"], [0.0]],
    ids=["reorder", "duplicate", "reorder-tail", "past-end", "negative", "mixed", "bool", "str", "float"],
)
def test_filter_refuses_bad_keep(keep: list[Any]) -> None:
    batch = admitted_batch(list("abcde"))
    cycle(batch, "a", 2, 1)
    refused(batch, lambda: batch.filter(keep), BatchShapeError)
    assert batch.retired_uids == []


def test_filter_uids_keeps_batch_order() -> None:
    batch = admitted_batch(list("abcd"))
    before = Snapshot.of(batch)
    batch.filter_uids(["d", "b"])
    check_reshape(before, batch)
    assert batch.uids == ["b", "d"]


def test_filter_uids_unknown() -> None:
    batch = admitted_batch(list("abc"))
    err = refused(batch, lambda: batch.filter_uids(["a", "zz"]), UnknownSequence)
    assert err.uid == "zz"  # type: ignore[attr-defined]


# -- step --------------------------------------------------------------------------------


def test_step_applies_per_row_event_lists() -> None:
    batch = admitted_batch(list("abc"))
    batch.step({"a": [draft(3), VERIFY, verified(3)], "b": [draft(2), VERIFY]})
    assert [row.state for row in batch] == [S("accepted"), S("verifying"), S("admitted")]
    assert batch.row("b").counters.pending == 2
    check_batch(batch)


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ({"a": draft(2), "b": VERIFY}, IllegalTransition),  # b is admitted: verify is illegal
        ({"a": [draft(2), verified(2)]}, IllegalTransition),  # illegal inside a row's list
        ({"a": draft(2), "b": draft(0)}, InvalidEvent),
        ({"a": [draft(2), VERIFY, verified(3)]}, InvalidEvent),  # 3 accepted of 2 pending
        ({"a": draft(2), "gone": draft(1)}, UnknownSequence),
        ({"c": [FINISH, FINISH]}, IllegalTransition),  # finished is final
    ],
)
def test_step_is_atomic(events: dict[Any, Any], error: type[LifecycleError]) -> None:
    batch = admitted_batch(list("abc"))
    cycle(batch, "c", 2, 1)
    refused(batch, lambda: batch.step(events), error)


def test_illegal_transition_names_row_state_event() -> None:
    batch = admitted_batch(["a"])
    err = refused(batch, lambda: batch.step({"a": VERIFY}), IllegalTransition)
    assert (err.sequence, err.state, err.event) == ("a", S("admitted"), VERIFY.event)  # type: ignore[attr-defined]


def test_removed_uids_are_unknown() -> None:
    batch = admitted_batch(list("abc"))
    batch.filter([1])
    for uid in ("a", "c", "never"):
        assert uid not in batch
        refused(batch, lambda u=uid: batch.step({u: FINISH}), UnknownSequence)
        refused(batch, lambda u=uid: batch.send(u, FINISH), UnknownSequence)
        with pytest.raises(UnknownSequence):
            batch.state(uid)
        with pytest.raises(KeyError):  # UnknownSequence is also a KeyError
            batch.index(uid)
    check_removed_uids_rejected(batch, batch.retired_uids + ["never"])


def test_removed_uid_may_rejoin_as_new_row() -> None:
    batch = admitted_batch(["a", "b"])
    cycle(batch, "a", 2, 2)
    batch.filter([1])
    batch.extend(["a"])
    assert batch.uids == ["b", "a"] and batch.state("a") == S("requested")
    assert batch.row("a").counters == Counters()
    check_removed_uids_rejected(batch, batch.retired_uids)
    assert batch.totals().accepted == 2  # the first life of "a" is retired, not lost


# -- resolve / suspend / resume / finish / fault --------------------------------------------


def test_resolve_admit_and_refuse() -> None:
    batch = Batch(["a", "b"])
    batch.resolve({"a": ADMIT, "b": REFUSE})
    assert [row.state for row in batch] == [S("admitted"), S("refused")]
    refused(batch, lambda: batch.resolve({"a": ADMIT}), IllegalTransition)


def test_late_refusal_refuses_an_admitted_row_for_good() -> None:
    batch = admitted_batch(list("abc"))
    cycle(batch, "b", 2, 1)  # rolled_back: a cycle boundary
    batch.suspend(["c"])
    assert batch.refuse(["a", "b", "c"], "head_shape_mismatch: late") == ["a", "b", "c"]
    assert {row.state for row in batch} == {S("refused")}
    batch.step({"a": PLAIN_STEP})  # refused rows decode plainly
    refused(batch, lambda: batch.step({"a": draft(1)}), IllegalTransition)
    refused(batch, lambda: batch.resume(["a"]), IllegalTransition)


def test_late_refusal_waits_for_the_cycle_boundary() -> None:
    batch = admitted_batch(["a"])
    batch.step({"a": [draft(2)]})  # drafting: drafts are pending
    refused(batch, lambda: batch.refuse(["a"], "late"), IllegalTransition)


# Each row: an operation, the events handed to it, and one event it does not carry.
@pytest.mark.parametrize(
    ("call", "event"),
    [
        (lambda b: b.step({"a": [draft(1), VERIFY, verified(1)], "b": SUSPEND}), "suspend"),
        (lambda b: b.step({"a": ADMIT}), "admit"),
        (lambda b: b.resolve({"a": draft(1)}), "draft"),
        (lambda b: b.apply("suspend", {"a": SUSPEND, "b": RESUME}), "resume"),
        (lambda b: b.apply("finish", {"a": FINISH, "b": FAULT}), "fault"),
    ],
)
def test_operations_refuse_events_the_spec_does_not_list(call: Callable[[Batch], Any], event: str) -> None:
    batch = admitted_batch(["a", "b"])
    err = refused(batch, lambda: call(batch), EventNotInOperation)
    assert err.event == event and event not in OPERATION_EVENTS[err.operation]  # type: ignore[attr-defined]


def test_operation_events_are_the_specs() -> None:
    assert {op: sorted(evs) for op, evs in OPERATION_EVENTS.items()} == {
        name: sorted(op.lifecycle_events) for name, op in BATCH_SPEC.operations.items()
    }
    assert operation_for(draft(1).event) == "step"
    assert operation_for(ADMIT.event) == "resolve" and operation_for(RESUME.event) == "resume"
    with pytest.raises(BatchShapeError):
        Batch().apply("reorder", {})


def test_suspend_resume_broadcast() -> None:
    batch = admitted_batch(list("abcde"))
    cycle(batch, "b", 2, 2)  # accepted
    cycle(batch, "c", 2, 0)  # rolled_back
    batch.step({"d": draft(2)})  # drafting: no cycle boundary, not suspendable
    batch.finish(["e"])  # final: never suspended
    chosen = batch.suspend(reason="policy")
    assert chosen == ["a", "b", "c"]
    assert [row.state for row in batch][:4] == [S("suspended")] * 3 + [S("drafting")]
    assert all(batch.row(u).counters.suspensions == 1 for u in chosen)
    assert batch.suspend() == []  # nothing left to suspend: a no-op, not an error
    batch.step({"a": PLAIN_STEP})
    assert batch.row("a").counters.suspended_steps == 1
    assert batch.resume(["b"]) == ["b"] and batch.state("b") == S("admitted")
    assert batch.resume() == ["a", "c"]
    assert all(batch.state(u) == S("admitted") for u in "abc")
    assert all(batch.row(u).counters.resumptions == 1 for u in "abc")
    check_batch(batch)


def test_suspend_resume_explicit_uids_are_atomic() -> None:
    batch = admitted_batch(list("abc"))
    batch.step({"b": draft(1)})
    refused(batch, lambda: batch.suspend(["a", "b"]), IllegalTransition)
    refused(batch, lambda: batch.resume(["a"]), IllegalTransition)
    refused(batch, lambda: batch.suspend(["a", "zz"]), UnknownSequence)


def test_finish_and_fault_discard_pending() -> None:
    batch = admitted_batch(list("ab"))
    batch.step({"a": draft(3), "b": [draft(2), VERIFY]})
    batch.fault(["b"], reason="boom")
    batch.finish(["a"], reason="stop")
    a, b = batch.row("a").counters, batch.row("b").counters
    assert (a.discarded, a.pending, b.discarded, b.faults, b.pending) == (3, 0, 2, 1, 0)
    assert batch.state("a") == S("finished") and batch.state("b") == S("faulted")
    batch.step({"b": PLAIN_STEP})
    assert b.emitted == 1
    refused(batch, lambda: batch.fault(["b"]), IllegalTransition)  # faulted already
    check_batch(batch)


# -- counters and totals --------------------------------------------------------------------


def test_counters_and_derived_figures() -> None:
    batch = admitted_batch(["a"])
    c = batch.row("a").counters
    assert c.acceptance_rate is None and c.mean_acceptance_length is None
    assert c.per_position_acceptance == []
    cycle(batch, "a", 3, 3)
    batch.step({"a": draft(3)})
    assert c.emitted == 4  # the pending drafts of the open cycle are not emitted
    batch.step({"a": [VERIFY, verified(1)]})
    assert (c.proposed, c.accepted, c.rejected, c.cycles, c.rollbacks) == (6, 4, 2, 2, 1)
    assert c.emitted == 3 + 1 + 1 + 1  # accepted drafts plus one bonus per cycle
    assert c.acceptance_rate == pytest.approx(4 / 6)
    assert c.mean_acceptance_length == pytest.approx((4 + 2) / 2)
    assert c.position_proposed == [2, 2, 2] and c.position_accepted == [2, 1, 1]
    assert c.per_position_acceptance == pytest.approx([1.0, 0.5, 0.5])
    summary = c.summary()
    assert summary["acceptance_rate"] == c.acceptance_rate
    check_batch(batch)


def test_totals_include_retired_rows() -> None:
    batch = admitted_batch(list("abc"))
    cycle(batch, "a", 2, 2)
    cycle(batch, "b", 3, 0)
    cycle(batch, "c", 1, 1)
    everything = batch.totals()
    batch.filter([2])
    assert batch.totals() == everything
    assert batch.retired.cycles == 2 and batch.retired.accepted == 2
    batch.filter([])
    assert batch.totals() == everything
    assert everything.acceptance_rate == pytest.approx(3 / 6)
    check_batch(batch)


# -- every invariant has a checker, and every checker can fail -----------------------------


def _corrupt_unique_uids(batch: Batch) -> None:
    batch._rows.append(Row(SequenceMachine("a")))


def _corrupt_pending(batch: Batch) -> None:
    batch.row("a").counters.pending = 1  # admitted, yet a draft is pending


def _corrupt_emitted(batch: Batch) -> None:
    batch.row("b").counters.emitted += 1  # a draft emitted before verification


def _corrupt_proposed(batch: Batch) -> None:
    batch.row("b").counters.proposed += 1


def _corrupt_positions(batch: Batch) -> None:
    batch.row("b").counters.position_accepted = [0, 2]


def _corrupt_totals(batch: Batch) -> None:
    batch.filter([0])  # retires "b" and its cycle
    live_only = total([row.counters for row in batch])
    batch.totals = lambda: live_only  # type: ignore[method-assign]  # forgets the retired rows


STATE_CORRUPTIONS: dict[str, list[Callable[[Batch], None]]] = {
    "unique_uids": [_corrupt_unique_uids],
    "pending_only_in_cycle": [_corrupt_pending],
    "counters_balance": [_corrupt_emitted, _corrupt_proposed],
    "position_counts": [_corrupt_positions],
    "totals_include_retired": [_corrupt_totals],
}


def _corrupt_reorder(batch: Batch) -> None:
    batch._rows.reverse()


def _corrupt_new_row_first(batch: Batch) -> None:
    batch._rows.insert(0, Row(SequenceMachine("new")))


def _corrupt_state(batch: Batch) -> None:
    batch.row("a").machine.state = S("faulted")


def _corrupt_counters(batch: Batch) -> None:
    batch.row("b").counters.plain_steps += 1


def _corrupt_payload(batch: Batch) -> None:
    batch.row("a").payload = object()


def _corrupt_lost_row(batch: Batch) -> None:
    batch._rows.pop()


RELATIONAL_CORRUPTIONS: dict[str, list[Callable[[Batch], None]]] = {
    "order_preserved": [_corrupt_reorder, _corrupt_new_row_first],
    "survivors_unchanged": [_corrupt_state, _corrupt_counters, _corrupt_payload],
    "atomic_step": [_corrupt_state, _corrupt_counters, _corrupt_lost_row],
}


def healthy_batch() -> Batch:
    batch = admitted_batch(["a", "b"], payloads=[object(), object()])
    cycle(batch, "b", 3, 1)
    return batch


def test_every_spec_invariant_has_a_checker_and_a_corruption() -> None:
    names = set(BATCH_SPEC.invariants)
    assert set(STATE_CHECKS) | set(RELATIONAL_CHECKS) == names
    assert not set(STATE_CHECKS) & set(RELATIONAL_CHECKS)
    assert set(STATE_CORRUPTIONS) | set(RELATIONAL_CORRUPTIONS) | {"removed_uids_rejected"} == names


@pytest.mark.parametrize(
    ("name", "corrupt"),
    [(n, f) for n, fs in STATE_CORRUPTIONS.items() for f in fs],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_state_checker_fails_on_corruption(name: str, corrupt: Callable[[Batch], None]) -> None:
    batch = healthy_batch()
    STATE_CHECKS[name](batch)  # healthy first
    corrupt(batch)
    with pytest.raises(InvariantViolation) as info:
        STATE_CHECKS[name](batch)
    assert info.value.invariant == name
    with pytest.raises(InvariantViolation):
        check_batch(batch)


@pytest.mark.parametrize(
    ("name", "corrupt"),
    [(n, f) for n, fs in RELATIONAL_CORRUPTIONS.items() for f in fs],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_relational_checker_fails_on_corruption(name: str, corrupt: Callable[[Batch], None]) -> None:
    batch = healthy_batch()
    before = Snapshot.of(batch)
    RELATIONAL_CHECKS[name](before, batch)  # healthy first
    corrupt(batch)
    with pytest.raises(InvariantViolation) as info:
        RELATIONAL_CHECKS[name](before, batch)
    assert info.value.invariant == name


class LeakyBatch(Batch):
    """A planted bug: an unknown uid falls back to row 0 instead of raising."""

    def index(self, uid: Any) -> int:
        return self._index.get(uid, 0)


def test_removed_uids_checker_fails_on_corruption() -> None:
    batch = LeakyBatch(["a", "b"])
    batch.filter([1])
    with pytest.raises(InvariantViolation) as info:
        check_removed_uids_rejected(batch, ["a"])
    assert info.value.invariant == "removed_uids_rejected"
