"""The loss curve both training loops record: the mean loss every 25 steps and at the last."""

from __future__ import annotations

import time
from collections.abc import Callable

EVERY = 25


class LossCurve:
    """Accumulates per-step losses; every ``EVERY`` steps (and at the last) it appends
    ``(step, mean loss)`` to ``points`` and logs it with the time per step so far."""

    def __init__(self, what: str, steps: int, log: Callable[[str], None]) -> None:
        self.what, self.steps, self.log = what, steps, log
        self.points: list[tuple[int, float]] = []
        self.t0, self.running = time.time(), 0.0

    def add(self, it: int, loss: float) -> None:
        self.running += loss
        if it % EVERY == 0 or it == self.steps:
            n = EVERY if it % EVERY == 0 else it % EVERY
            self.points.append((it, round(self.running / n, 4)))
            self.log(f"{self.what} step {it}/{self.steps} loss {self.running / n:.3f} "
                     f"({(time.time() - self.t0) / it * 1000:.0f} ms/step)")
            self.running = 0.0
