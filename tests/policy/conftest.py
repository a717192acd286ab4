"""Shared fixtures of the device-policy tests: canonical timings and a fake clock.

Nothing here measures anything real: timings are literals and the clock only advances
when a fake forward says so, so the tests are exact and instant.
"""

from __future__ import annotations

import pytest

from melix_fsm.policy.cost_model import AcceptancePrior, Timings

# Reference-BLAS float32: a 2-token forward costs 1.8x one token.
COMPUTE_BOUND = Timings(t_1=1.0, t_verify=1.8, t_head=0.1, k=1, batch_size=1)
# OpenBLAS / GPU: 3 tokens cost about what one does.
BANDWIDTH_BOUND = Timings(t_1=1.0, t_verify=1.02, t_head=0.08, k=2, batch_size=1)
PRIOR = AcceptancePrior(name="test", acceptance=0.8)


class FakeClock:
    """A timer whose time moves only when a fake forward advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def forward(self, *durations: float):
        """A forward that takes durations[i] on its i-th call (the last one repeats)."""
        calls = iter(range(10**9))

        def fn() -> None:
            i = next(calls)
            self.now += durations[min(i, len(durations) - 1)]

        return fn


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
