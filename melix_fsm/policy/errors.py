"""Typed errors of the device policy: calibration and controller misuse.

Rules of this module:
- Both classes derive from `melix_fsm.errors.MelixError` (that module is owned elsewhere;
  this one only subclasses its root), so one `except MelixError` still catches them.
- A `CalibrationError` always carries a machine-readable `reason`, one of
  `MEASUREMENT_REASONS`; `melix_fsm.policy.decision.decide` turns it into a fail-closed decision
  whose receipt reason is that same string. Nothing falls back to a guess silently.
- No mlx, no clock, no I/O here.
"""

from __future__ import annotations

from ..errors import MelixError

# Why a measurement produced no usable timings (values of melix_fsm.policy.decision.Reason).
MEASUREMENT_REASONS: tuple[str, ...] = (
    "measurement_failed",  # a timed forward raised, or returned a non-finite/non-positive time
    "measurement_timeout",  # the calibration ran past its time budget
    "measurement_poisoned",  # samples too spread out to trust (e.g. a prefill competed)
)


class PolicyError(MelixError):
    """The device policy was refused or misused; nothing changed."""


class CalibrationError(PolicyError):
    """Timing the model failed; `reason` says how, `detail` says what was seen."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in MEASUREMENT_REASONS:
            raise ValueError(f"unknown calibration failure reason {reason!r}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)
