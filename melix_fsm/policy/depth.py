"""Draft depth k chosen from measured throughput per depth, revisited live (pure, no clock).

Rules of this module:
- The chosen depth is the SMALLEST measured k whose throughput ties the best measured one
  (inside `tie`, or inside the measured noise when that is larger, one tolerance for all
  depths). So no chosen k ever measures slower than a smaller measured k, and a
  difference inside the noise goes to the cheaper, smaller depth.
- Depths are measured by exploring: every `every` speculative steps the chooser drafts at
  a neighbour of the chosen depth (k-1 or k+1) for `explore_steps` to `explore_max_steps`
  timed steps (ending early once the two rates differ beyond the tolerance), then chooses
  again. Explorations that change nothing back off geometrically, so a settled depth
  costs little; an upward step is skipped when the measured acceptance says the extra
  draft would add (almost) no tokens.
- Without timed samples (callers that pass no seconds) the cost model picks the depth:
  E[tokens](k) / cycle_cost(k) from the measured per-position acceptance, ties to the
  smaller k.
- Nothing here reads a clock; the caller (melix_fsm.policy.controller) feeds normalised
  throughput samples and calls `advance` once per speculative step.
- Whether k is fixed, held or explored is the machine of spec/depth.toml (`DEPTH`): the
  chooser changes it only by sending that file's events; k itself is data.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Literal

import msgspec

from ..machine import CompiledMachine
from ..spec import load_machine
from .errors import PolicyError
from .throughput import PositionAcceptance, Rate

AUTO_MAX_DEPTH = 4  # deeper chains rarely pay (acceptance decays geometrically per position)


class DepthMode(enum.StrEnum):
    """spec/depth.toml [states], in the spec's order (checked at import)."""

    configured = "configured"
    fixed = "fixed"
    holding = "holding"
    exploring = "exploring"


class DepthMove(enum.StrEnum):
    """spec/depth.toml [events], in the spec's order (checked at import)."""

    fix = "fix"
    choose = "choose"
    explore = "explore"
    conclude = "conclude"
    abort = "abort"
    rechoose = "rechoose"
    step_down = "step_down"


DEPTH: CompiledMachine[DepthMode, DepthMove] = CompiledMachine(
    load_machine("depth"), DepthMode, DepthMove, frozenset()
)


class DepthConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Constants of the live depth chooser (steps are speculative controller updates)."""

    first_after: int = 16  # speculative steps at the first depth before the first exploration
    every: int = 64  # ... and between later explorations
    backoff: float = 2.0  # an exploration that changed nothing multiplies the wait by this
    max_every: int = 1024  # ... up to this many steps
    explore_steps: int = 8  # timed steps measured at the explored depth, at least ...
    explore_max_steps: int = 64  # ... and at most: it ends earlier once the rates differ beyond the tie
    tie: float = 0.03  # relative throughput difference that is a tie (the smaller k wins) ...
    z: float = 2.5  # ... or z standard errors of the noisiest rate compared, when larger
    min_samples: int = 4  # timed steps before a depth's throughput counts as measured

    def __post_init__(self) -> None:
        if min(self.first_after, self.every, self.explore_steps, self.min_samples) < 1:
            raise PolicyError("depth: first_after, every, explore_steps and min_samples must be >= 1")
        if self.explore_max_steps < self.explore_steps or self.backoff < 1.0 or self.max_every < self.every:
            raise PolicyError("depth: explore_max_steps >= explore_steps, backoff >= 1, max_every >= every")
        if not 0.0 <= self.tie < 1.0:
            raise PolicyError(f"depth: tie must lie in [0, 1), got {self.tie}")


class DepthReason(enum.StrEnum):
    fixed = "fixed"  # the operator fixed k
    prior = "prior"  # first choice, from the calibrated cost model and the acceptance prior
    explore = "explore"  # an exploration window at a neighbouring depth starts
    measured_faster = "measured_faster"  # a depth measured faster (beyond the tie) and was adopted
    measured_tie = "measured_tie"  # the explored depth did not beat the chosen one: kept
    model = "model"  # no timed samples: the cost model with live acceptance chose
    lost_to_plain = "lost_to_plain"  # this depth lost to plain: the next probe drafts one fewer


class DepthDecision(msgspec.Struct, frozen=True, kw_only=True):
    """The depth a run starts with, as the receipt records it (the live choice is in stats)."""

    mode: Literal["fixed", "auto"]
    k: int  # the first cycles' depth
    max_k: int  # auto: the largest depth the controller may choose
    reason: DepthReason
    predicted_speedup: dict[str, float] = {}  # per candidate k, cost model x acceptance prior


class DepthEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One depth decision with the throughputs it was taken from."""

    step: int
    reason: DepthReason
    k_before: int
    k_after: int
    explored: int | None = None
    rates: dict[int, float] = {}  # measured normalised throughput per depth
    tolerance: float | None = None


class DepthChooser:
    """Chooses the draft depth of the next cycles from measured throughput per depth."""

    def __init__(
        self,
        *,
        max_k: int,
        initial_k: int,
        auto: bool,
        acceptance: PositionAcceptance,
        decay: float,
        config: DepthConfig | None = None,
    ) -> None:
        if not 1 <= initial_k <= max_k:
            raise PolicyError(f"depth: need 1 <= initial k <= max k, got {initial_k}, {max_k}")
        self.max_k = max_k
        self.auto = auto
        self.acceptance = acceptance
        self.config = config or DepthConfig()
        self.rates: dict[int, Rate] = {k: Rate(decay) for k in range(1, max_k + 1)}
        self.chosen = initial_k
        self.mode = DEPTH.tracker()
        self.mode.send(DepthMove.choose if auto else DepthMove.fix)
        self._explored = initial_k  # the neighbour a window drafts at (data of `exploring`)
        self.events: list[DepthEvent] = []
        self.explorations = 0
        self.changes = 0
        self._spec_steps = 0
        self._wait = self.config.first_after
        self._next = self._wait
        self._explore_timed = 0
        self._explore_total = 0
        self._last_direction = 1  # so the first exploration looks down first

    @property
    def exploring(self) -> int | None:
        """The depth an exploration window drafts at, or None outside one."""
        return self._explored if self.mode.state is DepthMode.exploring else None

    @property
    def k(self) -> int:
        """The depth the next speculative cycle drafts (an explored one during a window)."""
        return self.exploring if self.exploring is not None else self.chosen

    def observe(self, k: int, tokens: float, seconds: float) -> None:
        if 1 <= k <= self.max_k:
            self.rates[k].add(tokens, seconds)

    def measured_rates(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for k, rate in self.rates.items():
            value = rate.value
            if rate.n >= self.config.min_samples and value is not None:
                out[k] = value
        return out

    def tolerance(self, rates: dict[int, float]) -> float:
        """One tie tolerance for every depth compared: the configured floor or z x noise."""
        noise = max((self.rates[k].relative_noise for k in rates), default=0.0)
        noise = 0.0 if math.isinf(noise) else noise
        return min(max(self.config.tie, self.config.z * noise), 0.99)

    def choose(self) -> int:
        """The smallest measured depth whose throughput ties the best one; else the current."""
        rates = self.measured_rates()
        if not rates:
            return self.chosen
        best = max(rates.values())
        floor = best * (1.0 - self.tolerance(rates))
        return min(k for k, value in rates.items() if value >= floor)

    def abort(self) -> None:
        """Speculation stopped mid-window (a suspension): drop the exploration."""
        if self.mode.state is DepthMode.exploring:
            self.mode.send(DepthMove.abort)

    def advance(
        self, step: int, *, timed: bool, model_cost: Callable[[int], float] | None
    ) -> DepthEvent | None:
        """One speculative step has been observed; maybe start or finish an exploration.

        timed: the step's timing was usable. model_cost(k): the calibrated cycle cost at
        depth k (units of t_1) at the current batch size, when a cost model exists.
        """
        if not self.auto:
            return None
        cfg = self.config
        self._spec_steps += 1
        if self.exploring is not None:
            self._explore_total += 1
            self._explore_timed += timed
            if self._explore_timed < cfg.explore_steps and self._explore_total < cfg.explore_max_steps:
                return None
            if self._explore_total < cfg.explore_max_steps and not self._decided():
                return None  # a window inside the noise says nothing yet: keep measuring
            return self._finish(step)
        if self._spec_steps < self._next:
            return None
        self._next = self._spec_steps + self._wait
        if not timed:
            return self._by_model(step, model_cost)
        target = self._neighbour()
        if target is None:
            return None
        self._explored = target
        self.mode.send(DepthMove.explore)
        self._last_direction = target - self.chosen
        self._explore_timed = self._explore_total = 0
        self.rates[target].reset()  # the window is its own evidence
        self.explorations += 1
        return self._record(step, DepthReason.explore, self.chosen, self.chosen, explored=target)

    def _neighbour(self) -> int | None:
        down = self.chosen - 1 if self.chosen > 1 else None
        up = self.chosen + 1 if self.chosen < self.max_k and self._up_can_pay() else None
        if down is None or up is None:
            return down if up is None else up
        measured = self.measured_rates()
        if (down in measured) != (up in measured):
            return up if down in measured else down  # an unmeasured neighbour first
        return up if self._last_direction < 0 else down  # otherwise alternate

    def _up_can_pay(self) -> bool:
        """Could depth chosen+1 emit more, even if its new draft were kept as often as the last?

        Only measured acceptance prunes here, not the calibrated cost: the cost of the
        deeper cycle is what the exploration measures (backoff bounds what that costs).
        """
        k = self.chosen
        e_now = self.acceptance.expected_tokens(k)
        e_up = e_now + self.acceptance.position(k)  # P(k+1) <= P(k): chained drafts
        return e_up / e_now > 1.0 + self.config.tie

    def lost_to_plain(self, step: int) -> DepthEvent | None:
        """Speculation at the chosen depth measured no faster than plain (a suspension or a
        failed probe): the next speculative window drafts one fewer. A deeper cycle costs
        more than a shallower one, so its loss says nothing of k - 1; without this, a
        controller suspended at k = 2 would probe k = 2 for ever while k = 1 would pay
        (explorations run only while speculating)."""
        if not self.auto or self.chosen == 1:
            return None
        before = self.chosen
        self.chosen -= 1
        self.mode.send(DepthMove.step_down)
        self.changes += 1
        self._wait = self.config.every
        self._next = self._spec_steps + self._wait
        return self._record(step, DepthReason.lost_to_plain, before, self.chosen)

    def _decided(self) -> bool:
        """Does the explored depth differ from the chosen one beyond the tie tolerance?"""
        rates = self.measured_rates()
        if self.exploring not in rates or self.chosen not in rates:
            return False
        ratio = rates[self.exploring] / rates[self.chosen]
        return abs(ratio - 1.0) > self.tolerance(rates)

    def settle(self, step: int) -> DepthEvent | None:
        """Re-choose from the current rates (the caller runs this after every step outside
        windows): a chosen depth whose rate falls below a smaller depth's is dropped at
        once, not at the next exploration. An exploration window decides when it ends."""
        if not self.auto or self.exploring is not None:
            return None
        if self.chosen not in self.measured_rates():
            return None  # not measured yet (e.g. stepped down after a loss): its window decides
        before = self.chosen
        self.chosen = self.choose()
        if self.chosen == before:
            return None
        self.mode.send(DepthMove.rechoose)
        self.changes += 1
        self._wait = self.config.every
        reason = DepthReason.measured_faster
        return self._record(
            step, reason, before, self.chosen, tolerance=self.tolerance(self.measured_rates())
        )

    def _finish(self, step: int) -> DepthEvent:
        explored = self.exploring
        self.mode.send(DepthMove.conclude)
        before = self.chosen
        self.chosen = self.choose()
        rates = self.measured_rates()
        if self.chosen != before:
            self.changes += 1
            self._wait = self.config.every
            reason = DepthReason.measured_faster
        else:
            self._wait = min(self.config.max_every, math.ceil(self._wait * self.config.backoff))
            reason = DepthReason.measured_tie
        self._next = self._spec_steps + self._wait
        return self._record(
            step, reason, before, self.chosen, explored=explored, tolerance=self.tolerance(rates)
        )

    def rechoose_by_model(self, step: int, model_cost: Callable[[int], float] | None) -> DepthEvent | None:
        """auto depth outside a window: the cost model's best k at the acceptance as it stands
        (the controller's reprice, when the prompts replaced the prior)."""
        if not self.auto or self.mode.state is not DepthMode.holding:
            return None
        return self._by_model(step, model_cost)

    def _by_model(self, step: int, model_cost: Callable[[int], float] | None) -> DepthEvent | None:
        if model_cost is None:
            return None
        before = self.chosen
        self.chosen = model_choice(self.acceptance, model_cost, self.max_k, self.config.tie)
        if self.chosen == before:
            return None
        self.mode.send(DepthMove.rechoose)
        self.changes += 1
        return self._record(step, DepthReason.model, before, self.chosen)

    def _record(
        self,
        step: int,
        reason: DepthReason,
        before: int,
        after: int,
        *,
        explored: int | None = None,
        tolerance: float | None = None,
    ) -> DepthEvent:
        event = DepthEvent(
            step=step,
            reason=reason,
            k_before=before,
            k_after=after,
            explored=explored,
            rates=self.measured_rates(),
            tolerance=tolerance,
        )
        self.events.append(event)
        return event

    def summary(self) -> dict[str, object]:
        return {
            "depth": "auto" if self.auto else "fixed",
            "k": self.k,
            "k_chosen": self.chosen,
            "k_max": self.max_k,
            "depth_explorations": self.explorations,
            "depth_changes": self.changes,
            "rates_per_k": {str(k): v for k, v in self.measured_rates().items()},
        }


def model_choice(acceptance: PositionAcceptance, cost: Callable[[int], float], max_k: int, tie: float) -> int:
    """argmax_k E[tokens](k) / cost(k), the smallest k on a tie (the prior's depth)."""
    speedups = {k: acceptance.expected_tokens(k) / cost(k) for k in range(1, max_k + 1)}
    best = max(speedups.values())
    return min(k for k, s in speedups.items() if s >= best * (1.0 - tie))
