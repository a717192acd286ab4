"""Microbenchmark: the table-driven runtime machine against the python-statemachine oracle.

Rules of this script:
- A script, not a test: `python benchmarks/bench_fsm.py [--repeat N]`. It prints one line
  per figure, min and median of `timeit.repeat`, all measured in one run on one machine.
- A "transition" is one third of a draft(3) -> verify -> verified(3) cycle, so the
  figures include the payload checks, the guard and the counter effects.
- The batched step is 8 rows, each a full cycle, through `Batch.step` (plan all, then
  commit all), i.e. 24 transitions.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

from melix_fsm.batch import Batch
from melix_fsm.lifecycle import ADMIT, VERIFY, SequenceMachine, State, draft, verified
from melix_fsm.oracle import OracleMachine

ROWS = 8
CYCLE = (draft(3), VERIFY, verified(3))  # all accepted: accepted -> drafting -> ... -> accepted


def runtime_cycle() -> Callable[[], None]:
    machine = SequenceMachine("bench", State("accepted"))
    send = machine.send
    d, v, a = CYCLE

    def run() -> None:
        send(d)
        send(v)
        send(a)

    return run


def batch_step() -> Callable[[], None]:
    batch = Batch(range(ROWS))
    batch.resolve({uid: ADMIT for uid in range(ROWS)})
    events = {uid: CYCLE for uid in range(ROWS)}
    step = batch.step

    def run() -> None:
        step(events)

    return run


def oracle_cycle() -> Callable[[], None]:
    oracle = OracleMachine(State("accepted"))
    send = oracle.send

    def run() -> None:
        send("draft", pending=0, drafts=3, accepted=0)
        send("verify", pending=3, drafts=0, accepted=0)
        send("verified", pending=3, drafts=0, accepted=3)

    return run


def oracle_batch_step() -> Callable[[], None]:
    cycles = [oracle_cycle() for _ in range(ROWS)]

    def run() -> None:
        for cycle in cycles:
            cycle()

    return run


def measure(fn: Callable[[], None], number: int, repeat: int, per: int) -> tuple[float, float]:
    """(min, median) microseconds per unit, where one call of fn is `per` units."""
    fn()  # warm up (first-call caches, lazy imports)
    times = timeit.repeat(fn, number=number, repeat=repeat)
    per_call = [t / number / per * 1e6 for t in times]
    return min(per_call), statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rows = [
        ("runtime: us per transition", runtime_cycle(), 20_000, 3),
        (f"runtime: us per batched step ({ROWS} rows x 1 cycle)", batch_step(), 2_000, 1),
        ("oracle (python-statemachine): us per transition", oracle_cycle(), 300, 3),
        (f"oracle: us per {ROWS}-row step (sequential cycles)", oracle_batch_step(), 40, 1),
    ]
    results = {}
    print(f"{'figure':<56} {'min':>10} {'median':>10}")
    for label, fn, number, per in rows:
        lo, mid = measure(fn, number, args.repeat, per)
        results[label] = lo
        print(f"{label:<56} {lo:>10.2f} {mid:>10.2f}")
    ratio = results[rows[2][0]] / results[rows[0][0]]
    print(f"oracle / runtime per transition (min): {ratio:.0f}x")


if __name__ == "__main__":
    main()
