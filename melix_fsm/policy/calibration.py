"""Timing the three forwards the cost model needs, with typed failures.

Rules of this module:
- Pure: the forwards are callables the adapter builds (each runs one forward, forces
  its result, e.g. with mx.eval, and leaves its caches as it found them); the clock is
  an injected `timer`. Nothing here imports mlx.
- Warm-up rounds are discarded; each figure is the median of `runs` samples. The three
  forwards are timed interleaved (1, verify, head; 1, verify, head; ...) so that drift
  (clock boost, a neighbour's load) biases all three alike instead of one.
- Fail closed with a typed reason, never with a guess: an exception in a forward (or a
  time that is not positive) -> measurement_failed; the whole measurement running past
  `budget_s` -> measurement_timeout (checked between forwards: one hung forward is not
  interrupted); samples too spread out to trust (relative median absolute deviation above
  `max_spread`, e.g. a prefill competed for the device) -> measurement_poisoned.
- Across batch sizes the figures must agree with each other: a forward over more rows is
  never much cheaper than one over fewer, so a smaller batch measuring slower than a
  larger one by more than the spread limit ran in a slow window (`out_of_order`).
  `measure_table` re-measures once what looks poisoned (one process only: every rank of
  a group must run the same forwards) and refuses what still is; a re-measured entry
  says why (`Timings.remeasured`), and the decision's detail quotes it.
- Measure on rank 0 only under mx.distributed and broadcast the result (melix_fsm.policy.decision).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec

from .cost_model import Timings, TimingTable
from .errors import CalibrationError, PolicyError

Forward = Callable[[], object]

DEFAULT_RUNS = 7
DEFAULT_WARMUP = 2
DEFAULT_BUDGET_S = 120.0
# Relative MAD above which samples are refused. Quiet machines measure a few percent;
# a prefill running beside the calibration pushes it far past this.
DEFAULT_MAX_SPREAD = 0.25
# The forwards compared across batch sizes (the head's draft is too short to order reliably).
ORDERED_FIGURES = ("t_1", "t_verify")


def relative_mad(samples: list[float]) -> float:
    """Median absolute deviation over the median: robust to one or two stray samples."""
    med = statistics.median(samples)
    return statistics.median(abs(s - med) for s in samples) / med


def measure(
    fn_1: Forward,
    fn_verify: Forward,
    fn_head: Forward,
    *,
    k: int,
    batch_size: int = 1,
    runs: int = DEFAULT_RUNS,
    warmup: int = DEFAULT_WARMUP,
    timer: Callable[[], float] = time.perf_counter,
    budget_s: float = DEFAULT_BUDGET_S,
    max_spread: float = DEFAULT_MAX_SPREAD,
    note: str = "",
) -> Timings:
    """Median times of a 1-token step, a (k+1)-token verify and one head draft.

    Raises `CalibrationError` with reason measurement_failed, measurement_timeout or
    measurement_poisoned; `PolicyError` for nonsensical arguments.
    """
    if runs < 1 or warmup < 0 or k < 1 or batch_size < 1 or budget_s <= 0:
        raise PolicyError(f"measure: bad arguments runs={runs} warmup={warmup} k={k} B={batch_size}")
    forwards = (("t_1", fn_1), ("t_verify", fn_verify), ("t_head", fn_head))
    samples: dict[str, list[float]] = {name: [] for name, _ in forwards}
    start = timer()
    for round_ in range(warmup + runs):
        for name, fn in forwards:
            t0 = timer()
            try:
                fn()
            except Exception as exc:  # any failure of a forward is a typed refusal
                raise CalibrationError(
                    "measurement_failed", f"{name} forward raised {type(exc).__name__}: {exc}"
                ) from exc
            t1 = timer()
            elapsed = t1 - t0
            if not (math.isfinite(elapsed) and elapsed > 0.0):
                raise CalibrationError("measurement_failed", f"{name}: the timer read {elapsed!r} s")
            if t1 - start > budget_s:
                raise CalibrationError(
                    "measurement_timeout", f"{t1 - start:.3g} s spent, budget {budget_s:g} s (at {name})"
                )
            if round_ >= warmup:
                samples[name].append(elapsed)
    spreads = {name: relative_mad(values) for name, values in samples.items()}
    worst = max(spreads, key=spreads.__getitem__)
    if spreads[worst] > max_spread:
        raise CalibrationError(
            "measurement_poisoned",
            f"{worst} samples spread {spreads[worst]:.0%} (limit {max_spread:.0%}): "
            "something competed with the measurement",
        )
    return Timings(
        t_1=statistics.median(samples["t_1"]),
        t_verify=statistics.median(samples["t_verify"]),
        t_head=statistics.median(samples["t_head"]),
        k=k,
        batch_size=batch_size,
        runs=runs,
        spread=spreads[worst],
        note=note,
    )


def try_measure(
    fn_1: Forward, fn_verify: Forward, fn_head: Forward, **kw: object
) -> Timings | CalibrationError:
    """`measure`, with a typed failure returned instead of raised (ready for `decide`)."""
    try:
        return measure(fn_1, fn_verify, fn_head, **kw)  # type: ignore[arg-type]
    except CalibrationError as exc:
        return exc


class Clash(msgspec.Struct, frozen=True):
    """A smaller batch measuring slower than a larger one by more than the tolerance."""

    smaller: Timings
    larger: Timings
    figure: str  # one of ORDERED_FIGURES

    def __str__(self) -> str:
        slow, fast = getattr(self.smaller, self.figure), getattr(self.larger, self.figure)
        return (
            f"{self.figure} at B={self.smaller.batch_size} ({slow * 1e3:.2f} ms) above "
            f"B={self.larger.batch_size} ({fast * 1e3:.2f} ms): a window ran slow"
        )


def out_of_order(entries: Iterable[Timings], tolerance: float = DEFAULT_MAX_SPREAD) -> list[Clash]:
    """Every pair of batch sizes whose figures contradict each other (smaller B slower by
    more than `tolerance`, relative), smallest batch sizes first."""
    ordered = sorted(entries, key=lambda t: t.batch_size)
    return [
        Clash(small, large, figure)
        for i, small in enumerate(ordered)
        for large in ordered[i + 1 :]
        for figure in ORDERED_FIGURES
        if getattr(small, figure) > getattr(large, figure) * (1.0 + tolerance)
    ]


def measure_table(
    measure_at: Callable[[int], Timings],
    batch_sizes: Sequence[int],
    *,
    retry: bool = True,
    tolerance: float = DEFAULT_MAX_SPREAD,
) -> TimingTable:
    """A timing table from `measure_at(B)` at each batch size, checked across them.

    With `retry`, a batch size whose samples came back poisoned is measured once more, and
    so are both sides of every clash `out_of_order` finds; what is still poisoned or out
    of order then raises `CalibrationError("measurement_poisoned")`. Without it (a group
    of ranks) the first poisoned result raises. Other failures raise as they come.
    """

    def again(batch_size: int, why: str) -> Timings:
        return msgspec.structs.replace(measure_at(batch_size), remeasured=why)

    by_size: dict[int, Timings] = {}
    for batch_size in batch_sizes:
        try:
            by_size[batch_size] = measure_at(batch_size)
        except CalibrationError as exc:
            if not retry or exc.reason != "measurement_poisoned":
                raise
            by_size[batch_size] = again(batch_size, exc.detail)
    clashes = out_of_order(by_size.values(), tolerance)
    if clashes and retry:
        suspects: dict[int, str] = {}  # each suspect with the first clash it is in
        for clash in clashes:
            for timings in (clash.smaller, clash.larger):
                suspects.setdefault(timings.batch_size, str(clash))
        for batch_size, why in sorted(suspects.items()):
            by_size[batch_size] = again(batch_size, why)
        clashes = out_of_order(by_size.values(), tolerance)
    if clashes:
        raise CalibrationError("measurement_poisoned", str(clashes[0]))
    return TimingTable.of(*by_size.values())
