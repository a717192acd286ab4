"""The conformance driver: runs operations on a generator and checks every outcome.

Rules of this module:
- A driver owns one generator, seen through a `Surface` (melix_fsm.testing.surfaces: the
  adapters for mlx-lm >= 0.32 batch generators, 0.31-style ones and single-sequence
  streams), and the kit's view of every request it inserted: the expected tokens (the
  reference decoder's, cut at max_tokens and at the first stop sequence, inclusive), the
  tokens received, and whether it is queued, live, finished or removed.
- Operations are `insert`, `step` (one `next()`), `remove` and `drain` (step until every
  request ended). Each is recorded, before it runs, as a plain dict in `schedule`, the
  failing one last; requests are named by insertion index, not uid, so `replay` can
  re-run a schedule on a fresh generator without Hypothesis. `remove` only reaches the
  generator for requests still queued or live: removing an ended request is recorded
  and does nothing.
- Checks after each `next()`: the responses name live requests (and agree with the
  report when the generator reports); the report goes through a `ReportMirror`
  (lifecycle legality, invariants, counters, emissions, order); every request's tokens
  stay a prefix of the expected tokens and equal them when it finishes; a removed
  request's tokens stay a prefix; no row faults unless `allow_faults` (a fault is a
  swallowed exception: in a run that injects none, a bug). If the generator keeps a
  melix_fsm `Batch` in `.batch`, its order, states and invariants must match the mirror.
  `check_events=None` (the default) checks events exactly when the generator has a
  `last_report`.
- Divergences (melix_fsm.testing.divergence): without a `judge` every token that differs
  from the reference is a bug (exact: the identity tests). With one, the first divergent
  position of a request is judged by the reference's logits there: a near-tie (within the
  dtype's rounding scale) is recorded and ends the checks of that request's tokens (its
  stream continues from another context); anything else is `tokens_match_reference` as
  before, with the measured gap in its message and on the error (`divergence`). The judge
  counts the tokens compared. A request that ends short of or past the reference without
  a differing token is a bug either way.
- A sampled schedule (`check_tokens=False`: the generator samples at T > 0, so no greedy
  reference applies) checks everything but the tokens' values: each request gets at most
  `max_tokens` tokens and none after a completed stop sequence (`sampled_budget`). Its
  schedule starts with a `{"op": "sampling", "temperature": T}` marker, which `run`
  skips: whoever builds the driver picks the sampled generator for it.
- Every failure is a `ConformanceError` naming the property and where it happened
  (`where`: "first token" / "later token" for token mismatches, else the operation);
  an exception the generator raises becomes `generator_raised` (chained). The message
  ends with the schedule as JSON lines.
- Pure core: no mlx (the default reference and stop builder import it lazily), no Hypothesis.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from melix_fsm import invariants
from melix_fsm.batch import Batch
from melix_fsm.invariants import InvariantViolation
from melix_fsm.lifecycle import Event

from .divergence import BUG, DivergenceJudge
from .mirror import ConformanceError, ReportMirror
from .reference import Reference, cut_at_stop, memoized, mlx_greedy_reference
from .requests import FINISHED, LIVE, QUEUED, REMOVED, RequestSpec, Tracked
from .surfaces import Emission, SurfaceError, as_surface
from .tokens import check_sampled, first_difference, mismatch, note_joins, where

StopBuilder = Callable[[Sequence[Sequence[int]]], Any]

_FAULT = Event("fault")


class ConformanceDriver:
    """Drives one generator through recorded operations; see the module rules."""

    def __init__(
        self,
        generator: Any,
        reference: Reference,
        *,
        make_stops: StopBuilder | None = None,
        check_events: bool | None = None,
        allow_faults: bool = False,
        name: str = "",
        seed: Any = None,
        surface: str = "auto",
        known: Callable[[ConformanceError], bool] | None = None,
        check_tokens: bool = True,
        judge: DivergenceJudge | None = None,
    ) -> None:
        self.gen = generator
        self.check_tokens = check_tokens
        self.judge = judge  # None: every divergence is a bug (exact)
        self.known = known  # token mismatches it accepts taint their request instead of failing
        self.surface = as_surface(generator, surface, make_stops)
        self.reference = reference
        self.check_events = self.surface.report() is not None if check_events is None else check_events
        self.allow_faults = allow_faults
        self.name = name
        self.seed = seed
        self.mirror = ReportMirror()
        self.requests: list[Tracked] = []
        self.by_uid: dict[Any, Tracked] = {}
        self.schedule: list[dict[str, Any]] = []
        self.failed = False  # set by the first failure: the generator is then in an unknown state

    # -- operations ------------------------------------------------------------------
    def insert(self, specs: Sequence[RequestSpec]) -> list[int]:
        """Insert requests in one call; returns their insertion indices."""
        specs = list(specs)
        tracked = []
        for spec in specs:  # the reference runs first: its errors are not the generator's
            full = ()
            if self.check_tokens:
                full = tuple(self.reference(tuple(spec.prompt), spec.max_tokens))[: spec.max_tokens]
            tracked.append(Tracked(len(self.requests) + len(tracked), spec, cut_at_stop(full, spec.stops)))
        op: dict[str, Any] = {"op": "insert", "requests": [s.as_dict() for s in specs]}
        with self._recording(op):
            uids = list(self._call(lambda: self.surface.insert(specs)))
            op["uids"] = uids
            if len(uids) != len(specs) or len(set(uids)) != len(uids):
                raise ConformanceError("unknown_uid", f"insert of {len(specs)} prompts returned uids {uids}")
            for t, uid in zip(tracked, uids):
                if uid in self.by_uid:
                    raise ConformanceError("unknown_uid", f"insert returned uid {uid!r} a second time", uid)
                t.uid = uid
                self.requests.append(t)
                self.by_uid[uid] = t
        return [t.index for t in tracked]

    def remove(self, indices: Sequence[int]) -> None:
        """Remove requests (by insertion index); ended ones are not passed to the generator."""
        targets = [self.requests[i] for i in indices if self.requests[i].status in (QUEUED, LIVE)]
        op = {"op": "remove", "requests": list(indices), "uids": [t.uid for t in targets]}
        with self._recording(op):
            if targets:
                self._call(lambda: self.surface.remove([t.uid for t in targets]))
            live = [t.uid for t in targets if t.status == LIVE]
            for t in targets:
                if t.status in (QUEUED, LIVE):
                    t.status = REMOVED
            if self.check_events:
                self.mirror.remove(live)
                self._check_generator_batch()

    def step(self) -> None:
        """One `next()` and every check on its outcome."""
        with self._recording({"op": "next"}):
            self._step()

    def drain(self, max_steps: int | None = None) -> None:
        """Step until every request has finished or been removed; then all must be complete."""
        with self._recording({"op": "drain"}):
            if max_steps is None:  # every step should emit a token for every live row
                open_ = [t for t in self.requests if t.status in (QUEUED, LIVE)]
                max_steps = 16 + 4 * sum(t.spec.max_tokens for t in open_)
            for _ in range(max_steps):
                if not any(t.status in (QUEUED, LIVE) for t in self.requests):
                    break
                self._step()
            for t in self.requests:
                if t.status in (QUEUED, LIVE):
                    raise ConformanceError(
                        "completion",
                        f"request #{t.index} (uid {t.uid!r}) is still {t.status} after {max_steps} "
                        f"steps with {len(t.got)} of {len(t.expected)} tokens",
                        t.uid,
                    )

    def run(self, schedule: Sequence[Mapping[str, Any]]) -> None:
        """Perform recorded operations (the `schedule` of an earlier driver)."""
        for op in schedule:
            kind = op["op"]
            if kind == "insert":
                self.insert([RequestSpec.from_dict(r) for r in op["requests"]])
            elif kind == "next":
                self.step()
            elif kind == "remove":
                self.remove(list(op["requests"]))
            elif kind == "drain":
                self.drain()
            elif kind == "sampling":  # the marker of a sampled schedule: the caller built its generator
                self.schedule.append(dict(op))
            else:
                raise ValueError(f"unknown schedule operation {kind!r}")

    # -- checks ----------------------------------------------------------------------
    def _step(self) -> None:
        generation: list[Emission] = self._call(self.surface.step)
        per_uid: dict[Any, list[int]] = {}
        finished: list[Any] = []
        for r in generation:
            t = self.by_uid.get(r.uid)
            if t is None:
                raise ConformanceError("unknown_uid", f"next() returned a token for uid {r.uid!r}", r.uid)
            if t.status in (FINISHED, REMOVED) or r.uid in finished:
                raise ConformanceError(
                    "no_tokens_after_end",
                    f"uid {r.uid!r} (request #{t.index}) got token {int(r.token)} after it "
                    f"{'was removed' if t.status == REMOVED else 'finished'}",
                    r.uid,
                )
            per_uid.setdefault(r.uid, []).append(int(r.token))
            if r.finish_reason is not None:
                finished.append(r.uid)
        if self.check_events:
            self._check_report(per_uid, finished)
        wrong: list[ConformanceError] = []
        note_joins(self.requests, [self.by_uid[uid] for uid in per_uid])
        for uid, tokens in per_uid.items():
            t = self.by_uid[uid]
            if t.status == QUEUED:  # without reports, the first token is the join
                t.status = LIVE
            checked = self.check_tokens and not t.tainted
            t.got.extend(tokens)
            if not self.check_tokens:
                check_sampled(t)
            elif checked and tuple(t.got) != t.expected[: len(t.got)]:
                err = self._diverged(t)
                if err is not None:
                    wrong.append(err)
            if checked and self.judge is not None:  # up to the divergent token, when one ended the checks
                before = len(t.got) - len(tokens)
                self.judge.count_tokens(len(tokens) if not t.tainted else first_difference(t) + 1 - before)
        for uid in finished:
            t = self.by_uid[uid]
            t.status = FINISHED
            complete = not self.check_tokens or t.tainted or tuple(t.got) == t.expected
            if not complete and not any(e.uid == uid for e in wrong):
                err = self._diverged(t, finished=True)
                if err is not None:
                    wrong.append(err)
        for err in wrong:
            if self.known is None or not self.known(err):
                raise err
            # a known wrong-tokens bug: the generator is still coherent, so the example goes
            # on without checking this request's tokens again
            self.by_uid[err.uid].tainted = True

    def _diverged(self, t: Tracked, finished: bool = False) -> ConformanceError | None:
        """The error of a request whose tokens left the reference's; None for a judged near-tie."""
        at = first_difference(t)
        found = None
        if self.judge is not None and at < min(len(t.got), len(t.expected)):
            found = self.judge.judge(
                t.spec.prompt, t.expected[:at], t.expected[at], t.got[at], request=t.index, where=where(t)
            )
            if found.kind != BUG:
                t.divergence = found
                t.tainted = True  # its stream goes on from another context: not comparable
                return None
        detail = mismatch(t, finished=finished)
        if found is not None:
            detail += f"; {found.text()} (contract: {self.judge.contract.describe()})"
        err = ConformanceError("tokens_match_reference", detail, t.uid, where(t))
        err.divergence = found  # type: ignore[attr-defined]
        return err

    def _check_report(self, per_uid: dict[Any, list[int]], finished: list[Any]) -> None:
        report = self.surface.report()
        if report is None:
            raise ConformanceError("report_missing", "the generator has no last_report after next()")
        for uid in getattr(report, "joined", []):
            t = self.by_uid.get(uid)
            if t is None or t.status != QUEUED:
                what = "was never inserted" if t is None else f"is {t.status}, not queued"
                raise ConformanceError("unknown_uid", f"uid {uid!r} joined the batch but {what}", uid)
        reported = {r.uid: list(r.emitted) for r in getattr(report, "rows", [])}
        for uid in set(reported) | set(per_uid):
            if reported.get(uid, []) != per_uid.get(uid, []):
                raise ConformanceError(
                    "responses_match_report",
                    f"uid {uid!r}: next() returned tokens {per_uid.get(uid, [])} but the report says "
                    f"{reported.get(uid, 'nothing')}",
                    uid,
                )
        self.mirror.observe(report, finished)
        if not self.allow_faults:
            for r in report.rows:
                for signal in r.events:
                    if signal.event is _FAULT:
                        raise ConformanceError(
                            "no_silent_faults",
                            f"uid {r.uid!r} faulted ({signal.reason or 'no reason given'}): a speculative "
                            "forward raised and was swallowed (pass allow_faults=True when injecting faults)",
                            r.uid,
                        )
        for uid in report.joined:
            self.by_uid[uid].status = LIVE
        self._check_generator_batch()

    def _check_generator_batch(self) -> None:
        batch = self.surface.batch()
        if not isinstance(batch, Batch):
            return
        if batch.uids != self.mirror.uids:
            raise ConformanceError(
                "generator_batch", f"generator rows {batch.uids} != mirror {self.mirror.uids}"
            )
        for row in batch:
            mirror_row = self.mirror.batch.row(row.uid)
            if row.state != mirror_row.state:
                raise ConformanceError(
                    "generator_batch",
                    f"uid {row.uid!r} is {row.state.value!r} in the generator but its reported events "
                    f"lead to {mirror_row.state.value!r}",
                    row.uid,
                )
        try:
            invariants.check_batch(batch)
        except InvariantViolation as exc:
            raise ConformanceError("generator_batch", str(exc)) from None

    # -- plumbing --------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (ConformanceError, SurfaceError):  # the kit's own finding, or a usage error
            raise
        except Exception as exc:
            raise ConformanceError("generator_raised", f"{type(exc).__name__}: {exc}") from exc

    def _recording(self, op: dict[str, Any]) -> _Recording:
        return _Recording(self, op)

    def describe(self) -> str:
        """Where we are and the schedule so far, as JSON lines (attached to every failure)."""
        where = f"at operation #{len(self.schedule)} ({self.schedule[-1]['op'] if self.schedule else '-'})"
        if self.name:
            where += f" on {self.name}"
        if self.seed is not None:
            where += f", seed {self.seed}"
        lines = "\n".join(json.dumps(op, default=repr) for op in self.schedule)
        return f"{where}\nschedule (melix_fsm.testing.replay re-runs it without Hypothesis):\n{lines}"


class _Recording:
    """Context manager: record an operation; on failure attach the schedule to the error."""

    def __init__(self, driver: ConformanceDriver, op: dict[str, Any]) -> None:
        self.driver = driver
        self.op = op

    def __enter__(self) -> None:
        self.driver.schedule.append(self.op)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self.driver.failed = True
        if isinstance(exc, ConformanceError) and not exc.where:
            exc.where = "step" if self.op["op"] in ("next", "drain") else self.op["op"]
        if isinstance(exc, ConformanceError) and not exc.schedule:
            exc.attach(self.driver.describe(), [dict(op) for op in self.driver.schedule])


def replay(
    schedule: Sequence[Mapping[str, Any]],
    generator_factory: Callable[[], Any],
    reference: Reference | None = None,
    *,
    model: Any = None,
    make_stops: StopBuilder | None = None,
    check_events: bool | None = None,
    allow_faults: bool = False,
    surface: str = "auto",
    judge: DivergenceJudge | None = None,
) -> ConformanceDriver:
    """Re-run a recorded schedule on a fresh generator; raises the same ConformanceError.

    `reference` defaults to mlx-lm's greedy decoding of `model`. Returns the driver (its
    `requests` hold every request's expected and received tokens) when everything passes.
    """
    if reference is None:
        if model is None:
            raise ValueError("replay needs a reference decoder or the model to build mlx-lm's")
        reference = mlx_greedy_reference(model)
    driver = ConformanceDriver(
        generator_factory(),
        memoized(reference),
        make_stops=make_stops,
        check_events=check_events,
        allow_faults=allow_faults,
        surface=surface,
        judge=judge,
    )
    driver.run(schedule)
    return driver
