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
- Before the rounds, the probe schedules (melix_fsm.testing.probes) run: fixed shapes
  that reach every known bug class whatever the seed, greedy and, with a
  `sampled_factory`, sampled too. A probe that fails is shrunk and reported like a
  round's failure, then run again with that signature skipped (up to `PROBE_RERUNS`
  times), so one probe can reveal several bugs behind each other. A crash seen on both
  paths has one signature: it is one bug.
- A schedule that starts with a sampling marker runs on `sampled_factory()` with token
  values unchecked (melix_fsm.testing.driver); all others on `generator_factory()`.
- `progress(kind, value)`, when given, hears of each probe, example, round and bug.
- `judge` (a machine option): the divergence contract, given to every driver of the
  probes and rounds (they count tokens and divergences in its ledger); the replays that
  shrink a bug use its `silent()` twin, so a bug is not counted once per replay.
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

from .divergence import Divergence
from .driver import ConformanceDriver
from .machine import make_conformance_machine, profile_settings
from .mirror import ConformanceError
from .probes import is_sampled, probe_schedules
from .reference import Reference, memoized
from .shrink import Schedule, clean, shrink_schedule
from .signature import Signature, covers, same_cause, signature_of, skipped

PROBE_RERUNS = 4
Progress = Callable[[str, Any], None]


@dataclass
class Bug:
    signature: Signature
    prop: str
    detail: str
    schedule: Schedule
    found_ops: int
    seed: int | None
    flaky: bool = False
    also_seen: list[str] = field(default_factory=list)  # other runs that hit the same signature
    divergence: Divergence | None = None  # a wrong token's measured gap, when a judge ran

    def as_dict(self) -> dict[str, Any]:
        return {
            "signature": str(self.signature),
            "property": self.prop,
            "detail": self.detail,
            "schedule": self.schedule,
            "operations_before_shrink": self.found_ops,
            "seed": self.seed,
            "flaky": self.flaky,
            "also_seen": list(self.also_seen),
            "divergence": self.divergence.as_dict() if self.divergence is not None else None,
        }


@dataclass
class HuntResult:
    bugs: list[Bug] = field(default_factory=list)
    examples: int = 0
    rounds: int = 0
    skipped: list[str] = field(default_factory=list)
    probes: int = 0  # probe schedules run (each once, more when it revealed a bug)

    @property
    def causes(self) -> list[list[Bug]]:
        return group_causes(self.bugs)


def group_causes(bugs: Sequence[Bug]) -> list[list[Bug]]:
    """Bugs grouped by root cause (signature.same_cause): each group's first is its entry."""
    groups: list[list[Bug]] = []
    for bug in bugs:
        home = next((g for g in groups if any(same_cause(b.signature, bug.signature) for b in g)), None)
        if home is None:
            groups.append([bug])
        else:
            home.append(bug)
    return groups


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
    probes: bool = True,
    probe_options: Mapping[str, Sequence[Any]] | None = None,
    sampled_factory: Callable[[], Any] | None = None,
    sampled_temperature: float | None = None,
    progress: Progress | None = None,
    **machine_options: Any,
) -> HuntResult:
    """Hunt every distinct bug of `generator_factory()` against `reference` (module rules).

    Over 80 lines: its two phases (probe schedules, then Hypothesis rounds) share one
    hunt's state (the bugs found, the growing skip list) through the closures below.
    """
    tell = progress or (lambda kind, value: None)
    chosen = Settings(profile_settings(settings), database=None)
    reference = memoized(reference)
    patterns = list(skip)
    result = HuntResult(skipped=list(patterns))
    counter = [0]
    base = seed if seed is not None else random.SystemRandom().randrange(2**32)
    driver_options = {
        k: machine_options[k]
        for k in ("make_stops", "check_events", "allow_faults", "surface", "judge")
        if k in machine_options
    }

    driver_options["sampled_factory"] = sampled_factory

    def known(err: ConformanceError) -> bool:
        return skipped(signature_of(err), patterns)

    def record(bug: Bug, err: ConformanceError) -> None:
        result.bugs.append(bug)
        patterns.append(str(bug.signature))
        if str(signature_of(err)) != str(bug.signature):
            patterns.append(str(signature_of(err)))
        tell("bug", str(bug.signature))
        if on_bug is not None:
            on_bug(bug)

    if probes:
        tell("phase", "probes")
        temperature = sampled_temperature if sampled_factory is not None else None
        tokens = machine_options.get("tokens", (3, 255))
        shapes = probe_schedules(base, tokens=tokens, options=probe_options, temperature=temperature)
        for name, schedule in shapes:
            for _ in range(PROBE_RERUNS):
                result.probes += 1
                tell("probe", name)
                try:
                    err = replay_error(schedule, generator_factory, reference, known=known, **driver_options)
                except Exception:  # noqa: BLE001  (the reference refused the probe: not the generator's)
                    break
                if err is None or known(err):
                    break
                shrink_args = (generator_factory, reference, _silent(driver_options), max_replays, known)
                record(_shrunk_bug(err, False, base, *shrink_args), err)

    for round_index in range(max_rounds):
        round_seed = (base + round_index) % 2**32
        result.rounds += 1
        tell("round", f"{round_index + 1} (seed {round_seed}, {len(result.bugs)} bug(s) so far)")
        machine = make_conformance_machine(
            generator_factory,
            reference,
            skip=known,
            counter=counter,
            seed=round_seed,
            on_example=lambda: tell("example", None),
            **machine_options,
        )
        test = hypothesis.seed(round_seed)(get_state_machine_test(machine, settings=chosen))
        try:
            test()
        except BaseException as exc:  # noqa: BLE001  (Hypothesis wraps flaky failures in groups)
            err, flaky = _conformance_error(exc)
            if err is None:
                raise
            quiet = _silent(driver_options)
            bug = _shrunk_bug(err, flaky, round_seed, generator_factory, reference, quiet, max_replays, known)
            record(bug, err)
            continue
        break
    result.examples = counter[0]
    return result


def _silent(driver_options: dict[str, Any]) -> dict[str, Any]:
    """Driver options whose judge (if any) counts nothing: for the replays of a shrink."""
    judge = driver_options.get("judge")
    return {**driver_options, "judge": judge.silent()} if judge is not None else driver_options


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
    *,
    sampled_factory: Callable[[], Any] | None = None,
    **driver_options: Any,
) -> ConformanceError | None:
    """Replay a schedule on a fresh generator: the ConformanceError it raises, or None.

    A sampled schedule (a leading sampling marker) runs on `sampled_factory()`, tokens
    unchecked; without a sampled factory it cannot run and raises ValueError.
    """
    if is_sampled(schedule) is not None:
        if sampled_factory is None:
            raise ValueError("a sampled schedule needs the sampled generator")
        driver = ConformanceDriver(sampled_factory(), reference, check_tokens=False, **driver_options)
    else:
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
    known: Callable[[ConformanceError], bool] | None = None,
) -> Bug:
    signature = signature_of(err)
    found = clean(err.schedule)

    def fails(candidate: Schedule) -> bool:
        try:  # past the bugs already known, as the search ran: one of them may come first
            again = replay_error(candidate, factory, reference, known=known, **driver_options)
        except Exception:  # noqa: BLE001  (a broken candidate, e.g. the reference refusing it)
            return False
        # the same bug, possibly without an incidental trigger context of the first find
        return again is not None and covers(signature_of(again), signature)

    final = err
    schedule = found
    if not flaky and fails(found):
        schedule = shrink_schedule(found, fails, max_replays=max_replays)
        final = replay_error(schedule, factory, reference, known=known, **driver_options) or err
    schedule = clean(final.schedule or schedule)
    divergence = getattr(final, "divergence", None)
    bug = Bug(signature_of(final), final.prop, final.detail, schedule, len(found), seed, flaky)
    bug.divergence = divergence
    return bug
