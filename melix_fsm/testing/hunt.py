"""The bug hunt: run the conformance machine round after round, reporting each distinct bug once.

Rules of this module:
- A round is one Hypothesis search (`settings.max_examples` examples, each a schedule of
  operations). When a round fails, its shrunk counter-example is shrunk further by
  replay (melix_fsm.testing.shrink), its signature (melix_fsm.testing.signature) joins
  the skip list, and the next round starts with a new seed; an example that runs into a
  skipped signature ends quietly, so the search goes past every known bug. The hunt
  ends after a round that finds nothing new, or after `max_rounds` rounds.
- `skip` patterns given by the caller (known bugs) are skipped from the first round.
- A `Bug` is plain data: its signature, the failure's property and text, the shrunk
  schedule (replayable with `melix_fsm.testing.replay`), how many operations the
  schedule had before the replay shrink, and the round's seed.
- Every round runs without Hypothesis's example database: a known bug must not be
  replayed first in the next round, and runs stay independent of earlier ones.
- Pure core: no mlx.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis import settings as Settings
from hypothesis.stateful import get_state_machine_test

from .driver import ConformanceDriver
from .machine import make_conformance_machine, profile_settings
from .mirror import ConformanceError
from .reference import Reference, memoized
from .shrink import Schedule, clean, shrink_schedule
from .signature import Signature, signature_of, skipped


@dataclass
class Bug:
    signature: Signature
    prop: str
    detail: str
    schedule: Schedule
    found_ops: int
    seed: int | None
    flaky: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "signature": str(self.signature),
            "property": self.prop,
            "detail": self.detail,
            "schedule": self.schedule,
            "operations_before_shrink": self.found_ops,
            "seed": self.seed,
            "flaky": self.flaky,
        }


@dataclass
class HuntResult:
    bugs: list[Bug] = field(default_factory=list)
    examples: int = 0
    rounds: int = 0
    skipped: list[str] = field(default_factory=list)


def hunt_bugs(
    generator_factory: Callable[[], Any],
    reference: Reference,
    *,
    settings: Settings | str | None = None,
    seed: int | None = None,
    skip: Iterable[str] = (),
    max_rounds: int = 8,
    max_replays: int = 120,
    on_bug: Callable[[Bug], None] | None = None,
    **machine_options: Any,
) -> HuntResult:
    """Hunt every distinct bug of `generator_factory()` against `reference` (module rules)."""
    chosen = Settings(profile_settings(settings), database=None)
    reference = memoized(reference)
    patterns = list(skip)
    result = HuntResult(skipped=list(patterns))
    counter = [0]
    base = seed if seed is not None else random.SystemRandom().randrange(2**32)
    driver_options = {
        k: machine_options[k]
        for k in ("make_stops", "check_events", "allow_faults", "surface")
        if k in machine_options
    }

    def known(err: ConformanceError) -> bool:
        return skipped(signature_of(err), patterns)

    for round_index in range(max_rounds):
        round_seed = (base + round_index) % 2**32
        result.rounds += 1
        machine = make_conformance_machine(
            generator_factory, reference, skip=known, counter=counter, seed=round_seed, **machine_options
        )
        test = hypothesis.seed(round_seed)(get_state_machine_test(machine, settings=chosen))
        try:
            test()
        except BaseException as exc:  # noqa: BLE001  (Hypothesis wraps flaky failures in groups)
            err, flaky = _conformance_error(exc)
            if err is None:
                raise
            bug = _shrunk_bug(
                err, flaky, round_seed, generator_factory, reference, driver_options, max_replays
            )
            result.bugs.append(bug)
            patterns.append(str(bug.signature))
            if str(signature_of(err)) != str(bug.signature):
                patterns.append(str(signature_of(err)))
            if on_bug is not None:
                on_bug(bug)
            continue
        break
    result.examples = counter[0]
    return result


def _conformance_error(exc: BaseException) -> tuple[ConformanceError | None, bool]:
    if isinstance(exc, ConformanceError):
        return exc, False
    inner = getattr(exc, "exceptions", None)
    if inner:  # a FlakyFailure / ExceptionGroup: the generator failed, then did not
        for e in inner:
            found, _ = _conformance_error(e)
            if found is not None:
                return found, True
    return None, False


def replay_error(
    schedule: Sequence[Mapping[str, Any]],
    generator_factory: Callable[[], Any],
    reference: Reference,
    **driver_options: Any,
) -> ConformanceError | None:
    """Replay a schedule on a fresh generator: the ConformanceError it raises, or None."""
    driver = ConformanceDriver(generator_factory(), reference, **driver_options)
    try:
        driver.run(schedule)
    except ConformanceError as err:
        return err
    return None


def _shrunk_bug(
    err: ConformanceError,
    flaky: bool,
    seed: int,
    factory: Callable[[], Any],
    reference: Reference,
    driver_options: dict[str, Any],
    max_replays: int,
) -> Bug:
    signature = signature_of(err)
    found = clean(err.schedule)

    def fails(candidate: Schedule) -> bool:
        try:
            again = replay_error(candidate, factory, reference, **driver_options)
        except Exception:  # noqa: BLE001  (a broken candidate, e.g. the reference refusing it)
            return False
        return again is not None and signature_of(again) == signature

    final = err
    schedule = found
    if not flaky and fails(found):
        schedule = shrink_schedule(found, fails, max_replays=max_replays)
        final = replay_error(schedule, factory, reference, **driver_options) or err
    return Bug(
        signature, final.prop, final.detail, clean(final.schedule or schedule), len(found), seed, flaky
    )
