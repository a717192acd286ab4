"""The live controller's vocabulary: what it tells the engine, why, with which settings, and
what it records (melix_fsm.policy.controller holds the controller itself).

- `Action` / `LiveReason`: the switch at the next cycle boundary and its lifecycle reason.
- `LiveConfig`: the controller's constants, checked on construction.
- `Decision`: the value ranks share (speculating, k), as ints for a collective.
- `LiveEvent` / `LiveCounters` / `Estimate`: the recorded decisions, the run's counters and
  one speedup estimate with its noise and source.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from .decision import DEFAULT_MARGIN
from .depth import DepthConfig
from .errors import PolicyError


class Action(enum.StrEnum):
    """What the caller does at the next cycle boundary (as lifecycle suspend / resume events)."""

    keep = "keep"
    suspend = "suspend"
    resume = "resume"


class LiveReason(enum.StrEnum):
    """Why the live controller switched (the lifecycle suspend / resume reason)."""

    prior_admitted = "prior_admitted"  # the cost model admitted the start
    prior_disabled = "prior_disabled"  # the cost model disabled the start
    prompt_acceptance = "prompt_acceptance"  # the start re-decided on its sampled prompts' acceptance
    not_measured = "not_measured"  # auto without a calibration: disabled
    measured_slower = "measured_slower"  # speculative tokens/s measured below plain
    measured_faster = "measured_faster"  # a plain probe measured slower than speculation
    measured_tie = "measured_tie"  # no difference beyond the noise, speculation not slower: it stays on
    measured_not_faster = "measured_not_faster"  # a tie below 1: plain wins ties (suspended)
    plain_probe = "plain_probe"  # a plain window starts, to measure plain tokens/s live
    probe = "probe"  # a speculative window starts while suspended
    probe_passed = "probe_passed"  # the speculative probe measured faster: stay on
    probe_failed = "probe_failed"  # it did not: suspended again, longer wait
    probe_inconclusive = "probe_inconclusive"  # too few usable samples: back to where it was
    low_acceptance = "low_acceptance"  # the cost model at live acceptance: it no longer pays
    compute_bound = "compute_bound"  # untimed: not even perfect acceptance pays here
    above_threshold = "above_threshold"  # the estimate pays again
    shared_decision = "shared_decision"  # rank 0's decision replaced this rank's


class LiveConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Constants of the live controller (steps are `update` calls)."""

    decay: float = 0.98  # per-sample forgetting of the throughput sums (~50-step window)
    acceptance_decay: float = 0.95  # per-step forgetting of per-position acceptance
    z: float = 2.5  # a verdict must clear its threshold by this many standard errors
    alpha: float = 0.1  # EMA of accepted / proposed (reported; the untimed fallback)
    min_samples: int = 4  # timed steps before a side's throughput counts as measured
    every: int = 4  # compare the two sides every N steps
    suspend_below: float = 0.97  # suspend when measured speedup falls below this
    resume_above: float = 1.03  # resume only above this
    min_dwell: int = 16  # steps after a policy switch before the next one
    first_probe_after: int = 16  # steps before the first plain probe of a start the prior admitted, except:
    # speculation clearly beats the calibrated plain: the first plain probe later. The margin
    # covers the calibrated step's own error (a calibration in a slow window: live plain
    # 1.19x of it at B=1, benchmarks/bench_plain_calibration.py) and host work a pipelined
    # plain loop hides on a GPU; a smaller one speculates unmeasured where it errs
    defer_plain_above: float = 1.25
    # ... and only while the live cycles run at most this much faster than the calibration
    # priced them: beyond it the calibration itself is in doubt (taken in a slow window,
    # which prices the plain step too slow as well). Measured over ideal speedup ran
    # 0.64-1.19 in this project's benchmark cells; a calibration 1.7x slow was seen
    # (benchmarks/results/plain-check-round11.jsonl)
    defer_priced_within: float = 1.3
    # (and clearly below suspend_below against the calibrated plain: the first plain probe at once)
    # steps before the first speculative probe of a start the prior disabled: the prior is
    # evidence, and a probe that loses costs a visible share of a short run
    first_spec_probe_after: int = 64
    doubtful_probe_after: int = 256  # ... or 256 where not even perfect acceptance pays
    plain_probe_every: int = 128  # steps between plain probes while speculating ...
    probe_after: int = 64  # ... and between speculative probes while suspended
    probe_steps: int = 8  # timed steps in one probe window, at least ...
    probe_max_steps: int = 48  # ... a speculative probe runs on until its verdict is clear, up to this
    probe_backoff: float = 2.0  # each probe that confirms the current state doubles the wait
    probe_max_after: int = 1024  # ... up to this many steps
    # A scheduled probe starts only while the run can still emit this many tokens (the
    # `remaining` a decoder passes; None: no end in sight). A probe's window costs what the
    # losing side loses over probe_steps steps, and its verdict pays back only over the
    # steps left after it: with fewer than ~6 windows' worth left it cannot. 0: always probe
    probe_min_remaining: int = 48
    margin: float = DEFAULT_MARGIN  # the prior admits at predicted speedup >= 1 + margin
    depth: DepthConfig = DepthConfig()

    def __post_init__(self) -> None:
        if not (0.0 < self.decay < 1.0 and 0.0 < self.acceptance_decay <= 1.0 and 0.0 < self.alpha <= 1.0):
            raise PolicyError("live controller: decay in (0, 1), acceptance_decay and alpha in (0, 1]")
        if not self.suspend_below < self.resume_above:
            raise PolicyError("live controller: suspend_below must be below resume_above (the hysteresis)")
        small = (self.min_samples, self.every, self.first_probe_after, self.first_spec_probe_after)
        if min(*small, self.plain_probe_every, self.probe_after, self.probe_steps) < 1 or self.min_dwell < 0:
            raise PolicyError("live controller: step counts must be >= 1 (min_dwell >= 0)")
        if self.probe_max_steps < self.probe_steps or self.min_samples > self.probe_steps:
            raise PolicyError("live controller: probe_max_steps >= probe_steps >= min_samples")
        if self.doubtful_probe_after < 1 or self.defer_plain_above < self.resume_above:
            raise PolicyError("live controller: doubtful_probe_after >= 1, defer_plain_above >= resume_above")
        if self.probe_min_remaining < 0:
            raise PolicyError("live controller: probe_min_remaining must be >= 0")
        if self.defer_priced_within < 1.0:
            raise PolicyError("live controller: defer_priced_within must be >= 1")
        if self.probe_backoff < 1.0 or self.probe_max_after < max(self.probe_after, self.plain_probe_every):
            raise PolicyError("live controller: probe_backoff >= 1, probe_max_after >= the probe waits")


class Decision(msgspec.Struct, frozen=True):
    """What the next step does: the value ranks share (rank 0's wins)."""

    speculating: bool
    k: int

    def as_ints(self) -> tuple[int, int]:
        """For a collective: e.g. all_sum of [speculating, k] with zeros off rank 0."""
        return int(self.speculating), self.k

    @classmethod
    def from_ints(cls, values: Sequence[float]) -> Decision:
        return cls(bool(round(values[0])), max(1, int(round(values[1]))))


class LiveEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded on/off decision with the measurements it was taken from."""

    step: int
    action: Action
    reason: str  # a LiveReason, or the calibration's failure reason for a disabled start
    batch_size: int
    k: int
    speculating: bool  # after the decision
    measured_speedup: float | None = None  # speculative / plain normalised tokens/s
    spec_rate: float | None = None
    plain_rate: float | None = None
    predicted_speedup: float | None = None  # the cost model's, with live acceptance
    source: str = ""  # measured | measured_spec (vs the calibrated plain) | model | none


class LiveCounters(msgspec.Struct, kw_only=True):
    """Counters of one run (the stats' `policy` block)."""

    steps: int = 0
    steps_speculative: int = 0  # steps that drafted
    steps_plain: int = 0
    steps_suspended: int = 0  # steps taken while the controller said plain
    steps_excluded: int = 0  # timing unused: the step overlapped a prefill or followed a switch
    steps_untimed: int = 0  # steps fed without seconds
    evaluations: int = 0
    suspend_decisions: int = 0
    resume_decisions: int = 0  # passed probes included
    plain_probes: int = 0
    plain_probes_deferred: int = 0  # first plain probes put off: speculation clearly ahead
    calibration_doubted: int = 0  # ... not put off: live cycles ran well faster than calibrated
    probes: int = 0  # speculative probes while suspended
    probes_passed: int = 0
    probes_failed: int = 0
    probes_inconclusive: int = 0
    probes_skipped_short: int = 0  # scheduled probes not run: too few tokens left to pay for one
    shared_overrides: int = 0  # updates where rank 0's decision replaced this rank's


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    speedup: float | None
    source: str
    noise: float = 0.0  # relative standard error of the speedup (0: a model figure)
    spec_rate: float | None = None
    plain_rate: float | None = None
    predicted: float | None = None
