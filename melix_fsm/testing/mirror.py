"""The report mirror: replays a generator's StepReports into a shadow Batch and judges them.

Rules of this module:
- The mirror never asks the generator what should happen. It keeps its own
  `melix_fsm.batch.Batch` and, for each `StepReport` (melix_fsm.report), checks in this
  order: the rows of the step are the mirror's rows then the joiners (`row_order`); the
  report's own shape (`report_shape`, via `validate_report`); `extend(joined)` and one
  atomic `step` of every row's events (`legal_transitions`); the batch invariants of
  spec/batch.toml (`batch_invariants`); reported counters equal the mirror's
  (`counters_agree`); each row emitted exactly the tokens its events allow
  (`emitted_matches_events`); rows leave exactly when they finish (`finish_consistency`);
  then `filter(left)` and the reported order equals the mirror's (`row_order`).
- Every miss raises `ConformanceError` naming the property, the uid and (for lifecycle
  misses) the state and event; the mirror is then unusable, as the generator is.
- Pure core: no mlx, no Hypothesis. Generator authors may drive a `ReportMirror` from
  their own loops (`mirror.observe(gen.last_report)` after each `next()`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from melix_fsm import invariants
from melix_fsm.batch import Batch, operation_for
from melix_fsm.errors import IllegalTransition, InvalidEvent, LifecycleError, MelixError
from melix_fsm.invariants import InvariantViolation, Snapshot
from melix_fsm.lifecycle import Event
from melix_fsm.report import InvalidReport, StepReport, validate_report

# The properties the kit checks, with what a miss means (docs/conformance.md explains each).
PROPERTIES: dict[str, str] = {
    "report_missing": "the generator exposes no `last_report` StepReport after next()",
    "report_shape": "a StepReport is inconsistent on its own (melix_fsm.report.validate_report)",
    "row_order": "the step's rows or the reported order differ from the mirror batch "
    "(survivors keep their order, joiners are appended)",
    "legal_transitions": "a reported lifecycle event is not a transition of spec/lifecycle.toml",
    "batch_invariants": "a batch invariant of spec/batch.toml fails after a step",
    "counters_agree": "reported counters differ from the counters the events imply",
    "emitted_matches_events": "a row emitted a number of tokens its events do not allow "
    "(a draft emitted before or without verification, or a rolled-back draft emitted)",
    "finish_consistency": "a row left without finishing, finished without leaving, or "
    "responses and report disagree about who finished",
    "responses_match_report": "the tokens a row reports differ from the responses next() returned",
    "tokens_match_reference": "a request's tokens differ from the reference decoder's",
    "sampled_budget": "a sampled request got more than max_tokens tokens, or tokens after a completed "
    "stop sequence",
    "no_tokens_after_end": "a request produced a token after it finished or was removed",
    "unknown_uid": "the generator reported or returned a uid the kit never got from insert()",
    "generator_batch": "the generator's own melix_fsm Batch disagrees with the mirror or breaks an invariant",
    "completion": "a request never finished although the generator was drained",
    "no_silent_faults": "a row faulted (a speculative forward raised and was swallowed) in a run "
    "that injects no faults",
    "generator_raised": "the generator raised an exception",
    "sampled_distribution": "sampled tokens at some position do not follow the target's probabilities "
    "(a G-test at the stated false-alarm rate)",
    "impossible_token": "a sampled token has probability zero under the target's distribution",
}

_VERIFIED = Event("verified")
_PLAIN = Event("plain_step")
_FINISH = Event("finish")


class ConformanceError(MelixError, AssertionError):
    """A conformance property failed. `prop` names it (a key of PROPERTIES), `uid` the row.

    `schedule` (set by the driver) holds the operations performed so far as plain dicts,
    the failing one last: `melix_fsm.testing.replay` re-runs them without Hypothesis.
    `where` says where in a request's life it failed (melix_fsm.testing.signature uses it
    to tell distinct bugs apart); the driver fills it in when the raiser did not.
    """

    def __init__(self, prop: str, detail: str, uid: Any = None, where: str = "") -> None:
        if prop not in PROPERTIES:
            raise ValueError(f"unknown conformance property {prop!r}")
        self.prop = prop
        self.detail = detail
        self.uid = uid
        self.where = where
        self.schedule: list[dict[str, Any]] = []
        self.context = ""
        super().__init__(self._text())

    def _text(self) -> str:
        head = f"conformance property {self.prop!r} violated: {self.detail}"
        return head + (f"\n{self.context}" if self.context else "")

    def attach(self, context: str, schedule: list[dict[str, Any]]) -> None:
        """Add where it happened and the replayable schedule to the message."""
        self.context = context
        self.schedule = schedule
        self.args = (self._text(),)

    def __str__(self) -> str:
        return self._text()


def allowed_emissions(events: Iterable[Any], joined: bool) -> int:
    """Tokens a row may emit in a step with these events (the report contract)."""
    n = 1 if joined else 0  # the prefill's first token
    for signal in events:
        if signal.event is _VERIFIED:
            n += signal.accepted + 1
        elif signal.event is _PLAIN:
            n += 1
    return n


class ReportMirror:
    """A shadow Batch fed with StepReports; see the module rules."""

    def __init__(self) -> None:
        self.batch = Batch()
        self.steps = 0

    @property
    def uids(self) -> list[Any]:
        return self.batch.uids

    def remove(self, uids: Iterable[Any]) -> None:
        """The caller removed rows between steps: finish them and filter them out."""
        leaving = [uid for uid in uids if uid in self.batch]
        if not leaving:
            return
        before = Snapshot.of(self.batch)
        self.batch.finish(leaving, reason="removed")
        self.batch.filter_uids([uid for uid in self.batch.uids if uid not in set(leaving)])
        self._invariants(before)

    def observe(self, report: Any, finished: Iterable[Any] | None = None) -> None:
        """Check one step's report against the mirror, then move the mirror past the step.

        `finished`: uids whose responses in this step carried a finish_reason (None to skip
        that cross-check when the caller has no responses).
        """
        self.steps += 1
        if not isinstance(report, StepReport):
            kind = type(report).__name__
            raise ConformanceError("report_missing", f"last_report is a {kind}, not a StepReport")
        before = list(self.batch.uids)
        rows = [r.uid for r in report.rows]
        joined = list(report.joined)
        if rows != before + joined:
            raise ConformanceError(
                "row_order",
                f"the step's rows are {rows}, expected the batch's rows {before} then the joiners {joined}",
            )
        left = set(report.left)
        expected_order = [uid for uid in rows if uid not in left]
        if list(report.order) != expected_order:
            raise ConformanceError(
                "row_order",
                f"reported order {list(report.order)} != {expected_order} "
                f"(survivors {[u for u in before if u not in left]} keep their order, "
                f"joiners {joined} follow)",
            )
        try:
            validate_report(report)
        except InvalidReport as exc:
            raise ConformanceError("report_shape", exc.problem) from None
        self._apply(report, before)
        self._check_rows(report, set(joined), set(finished) if finished is not None else None)
        snap = Snapshot.of(self.batch)
        self.batch.filter_uids([uid for uid in self.batch.uids if uid not in left])
        self._invariants(snap)
        if self.batch.uids != list(report.order):
            raise ConformanceError("row_order", f"mirror order {self.batch.uids} != reported {report.order}")

    def _apply(self, report: StepReport, before: list[Any]) -> None:
        snap = Snapshot.of(self.batch)
        try:
            self.batch.extend(report.joined)
        except LifecycleError as exc:
            raise ConformanceError("row_order", f"joiners {report.joined} cannot join: {exc}") from None
        self._invariants(snap)
        events = {r.uid: list(r.events) for r in report.rows if r.events}
        try:
            # A report mixes operations (resolution, policy, the cycle); each event goes
            # through the batch operation that carries it, in the row's order. The first
            # refusal ends the run, so the mirror needs no atomicity across rows here.
            for uid, signals in events.items():
                for signal in signals:
                    self.batch.apply(operation_for(signal.event), {uid: signal})
        except IllegalTransition as exc:
            history = [s.event.value for s in events.get(exc.sequence, [])]
            raise ConformanceError(
                "legal_transitions",
                f"uid {exc.sequence!r}: event {_name(exc.event)!r} is illegal in state "
                f"{_name(exc.state)!r} (the row's events this step: {history}; state before the step: "
                f"{_name(self._state_or_initial(exc.sequence))!r})",
                uid=exc.sequence,
            ) from None
        except InvalidEvent as exc:
            raise ConformanceError(
                "legal_transitions",
                f"uid {exc.sequence!r}: event {_name(exc.event)!r}: {exc.detail}",
                uid=exc.sequence,
            ) from None
        try:
            invariants.check_batch(self.batch)
        except InvariantViolation as exc:
            raise ConformanceError("batch_invariants", str(exc)) from None

    def _state_or_initial(self, uid: Any) -> Any:
        return self.batch.state(uid) if uid in self.batch else "?"

    def _check_rows(self, report: StepReport, joined: set[Any], finished: set[Any] | None) -> None:
        left = set(report.left)
        for r in report.rows:
            row = self.batch.row(r.uid)
            if r.counters is not None and r.counters != row.counters:
                diff = _diff(r.counters, row.counters)
                raise ConformanceError(
                    "counters_agree",
                    f"uid {r.uid!r} in state {row.state.value!r}: reported counters differ from the "
                    f"events' ({diff}; events this step: {[s.event.value for s in r.events]})",
                    uid=r.uid,
                )
            allowed = allowed_emissions(r.events, r.uid in joined)
            ended = any(s.event is _FINISH for s in r.events)
            n = len(r.emitted)
            if n > allowed or (n < allowed and not ended):
                raise ConformanceError(
                    "emitted_matches_events",
                    f"uid {r.uid!r} emitted {n} tokens {r.emitted} but its events "
                    f"{_describe(r.events)}{' (joined: +1 first token)' if r.uid in joined else ''} "
                    f"allow exactly {allowed}",
                    uid=r.uid,
                )
            final = row.machine.is_final
            if final != (r.uid in left):
                what = "finished but did not leave" if final else f"left in state {row.state.value!r}"
                raise ConformanceError("finish_consistency", f"uid {r.uid!r} {what}", uid=r.uid)
        if finished is not None and finished != left:
            raise ConformanceError(
                "finish_consistency",
                f"responses finished {sorted(finished, key=repr)} but the report's left is {report.left}",
            )

    def _invariants(self, before: Snapshot) -> None:
        try:
            invariants.check_reshape(before, self.batch)
        except InvariantViolation as exc:
            raise ConformanceError("batch_invariants", str(exc)) from None


def _name(value: Any) -> Any:
    return getattr(value, "value", value)


def _describe(events: list[Any]) -> list[str]:
    out = []
    for s in events:
        if s.event is _VERIFIED:
            out.append(f"verified(accepted={s.accepted})")
        elif s.event is Event("draft"):
            out.append(f"draft({s.drafts})")
        else:
            out.append(s.event.value)
    return out


def _diff(reported: Any, mirror: Any) -> str:
    parts = []
    for name in type(mirror).__struct_fields__:
        a, b = getattr(reported, name), getattr(mirror, name)
        if a != b:
            parts.append(f"{name}: reported {a}, events imply {b}")
    return "; ".join(parts)
