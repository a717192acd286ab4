"""Where a speculative cycle's wall time goes: the engine's optional instrument (bench).

Plain data the engine adds host seconds to; no mlx, no decisions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CycleClock:
    """Where a speculative cycle's wall time goes (host seconds, summed over cycles).

    build: constructing the lazy graph; dispatch: `mx.async_eval` (on a CPU it returns
    only once most of the device work has run); sync: the one `mx.eval` wait; rollback:
    reading results and trimming caches; outside: the caller's bookkeeping between a
    settle and the next launch (emission, lifecycle, policy).
    """

    cycles: int = 0
    build: float = 0.0
    dispatch: float = 0.0
    sync: float = 0.0
    rollback: float = 0.0
    outside: float = 0.0
    _last_settle: float | None = None

    def interrupt(self) -> None:
        """The caller did other work since the last settle (a prefill of joining rows): the
        gap to the next launch is not the caller's bookkeeping, so it is not counted."""
        self._last_settle = None

    def merge(self, other: CycleClock) -> None:
        """Add another run's totals (each run keeps its own clock: gaps between runs are not cycles)."""
        self.cycles += other.cycles
        for name in ("build", "dispatch", "sync", "rollback", "outside"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def per_cycle(self) -> dict[str, float]:
        n = max(self.cycles, 1)
        return {k: getattr(self, k) / n for k in ("build", "dispatch", "sync", "rollback", "outside")}
