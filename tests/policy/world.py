"""A synthetic decode workload for the live controller: exact, seeded, instant.

The world says how long a plain step and a speculative cycle at depth k take, and how
often each draft position is kept; an obedient engine drafts exactly when the controller
says so, at the controller's k, and reports the step as the real engine will.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.live_types import Action


@dataclass
class World:
    plain_s: float = 1.0  # one plain step (B rows x 1 token)
    cycle_s: Callable[[int], float] = lambda k: 1.05 + 0.1 * k  # one cycle at depth k
    keep: float = 0.8  # P(draft p kept | drafts before it kept): chained geometric
    noise: float = 0.0  # relative, uniform: each step's time is x (1 +- noise)
    batch_size: int = 1
    seed: int = 0
    budget: int | None = None  # tokens the run may still emit, passed as `remaining` (None: no end)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _jitter(self, seconds: float) -> float:
        return seconds * (1.0 + self.noise * (2.0 * self.rng.random() - 1.0))

    def true_speedup(self, k: int) -> float:
        expected = sum(self.keep**i for i in range(k + 1))
        return expected * self.plain_s / self.cycle_s(k)

    def step(self, ctrl: LiveController, *, exclude: bool = False, timed: bool = True) -> tuple[Action, bool]:
        """One engine step as the controller asks; (action, whether it drafted)."""
        B = self.batch_size
        if not ctrl.speculating:
            seconds = self._jitter(self.plain_s) if timed else None
            remaining = self._spend(B)
            return ctrl.update(B, seconds=seconds, tokens=B, exclude=exclude, remaining=remaining), False
        k = ctrl.k
        per_position = [0] * k
        for _ in range(B):
            for p in range(k):
                if self.rng.random() >= self.keep:
                    break
                per_position[p] += 1
        accepted = sum(per_position)
        seconds = self._jitter(self.cycle_s(k)) if timed else None
        action = ctrl.update(
            B,
            accepted,
            B * k,
            seconds=seconds,
            tokens=accepted + B,
            accepted_per_position=per_position,
            exclude=exclude,
            remaining=self._spend(accepted + B),
        )
        return action, True

    def _spend(self, tokens: int) -> int | None:
        """What the budget leaves after a step emitting `tokens` (None: no budget)."""
        if self.budget is not None:
            self.budget = max(self.budget - tokens, 0)
        return self.budget


def run(world: World, ctrl: LiveController, steps: int, **kw: bool) -> list[tuple[Action, bool]]:
    return [world.step(ctrl, **kw) for _ in range(steps)]
