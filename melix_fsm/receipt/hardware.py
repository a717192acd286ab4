"""The receipt once the device policy has measured the loaded model (`with_hardware`).

`resolve` runs before any weight loads, so its hardware gate says `not_evaluated`; this
fills in the gate, the measured figures and, when the gate disables speculation, the
typed refusal `device_policy_disabled`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..policy.decision import HardwareDecision
from ..policy.depth import DepthDecision
from ..reasons import RefusalReason
from .schema import HardwareGate, Mode, Receipt


def with_hardware(
    receipt: Receipt, decision: HardwareDecision, depth: DepthDecision | None = None
) -> Receipt:
    """The receipt once the device policy has measured the loaded model.

    An admitted start whose gate comes out disabled becomes a refusal with reason
    `device_policy_disabled`; its lifecycle row is admitted and then suspended by the
    policy (not refused). The live controller may resume it when speculation measures
    faster, except after a failed calibration, which disables it for the run.
    `depth`: the depth the run starts with (the live controller's `depth_decision`).
    """
    changes: dict[str, Any] = {
        "hardware_gate": HardwareGate(decision.hardware_gate.value),
        "hardware": decision,
        "operator_override": receipt.operator_override or decision.operator_override,
        "depth": depth,
    }
    if receipt.mode is Mode.accepted:
        if decision.speculate:
            changes["message"] = receipt.message.replace(
                "; hardware gate not evaluated", f"; hardware gate admitted ({decision.reason.value})"
            )
        else:
            changes.update(
                mode=Mode.refused,
                lifecycle_state="suspended",
                refusal_reason=RefusalReason.device_policy_disabled,
                message=_disabled_message(decision),
            )
    return msgspec.structs.replace(receipt, **changes)


def _disabled_message(decision: HardwareDecision) -> str:
    """Says whether the live controller may still resume (a measured prior) or never will."""
    measured = decision.predicted_speedup is not None and decision.hardware_policy.value == "auto"
    when = "at start" if measured else "for this run"
    message = (
        f"device policy {decision.hardware_policy.value} disabled speculation {when}: {decision.reason.value}"
    )
    if measured:
        message += (
            f" (predicted speedup {decision.predicted_speedup:.2f}); resumed only where a live probe "
            "measures speculation faster"
        )
    return message
