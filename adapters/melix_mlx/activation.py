"""Device-policy evaluation of a loaded model: measure, decide, update the receipt.

Rules of this module:
- Runs after the weights are loaded and before any prompt is served (timings taken beside
  a prefill would poison the decision). Under `auto` it calibrates at the batch size
  that will be served; `force_on` / `force_off` skip the measurement and are recorded as
  operator overrides.
- The decision goes into the receipt (melix_fsm.receipt.with_hardware) and, under
  `auto`, into an `ActivationController` the decoders consult every step; a start the
  gate disables begins suspended and the controller may resume it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from melix_fsm.config import SpeculativeConfig
from melix_fsm.policy import (
    ActivationController,
    HardwareDecision,
    Policy,
    TimingTable,
    acceptance_prior,
    decide,
)
from melix_fsm.receipt import Receipt, with_hardware
from melix_fsm.telemetry import detect

from .calibrate import calibrate, device_kind, model_dtype


@dataclass
class Activation:
    receipt: Receipt
    decision: HardwareDecision
    controller: ActivationController | None


def evaluate(
    model: nn.Module,
    head: Any,
    receipt: Receipt,
    config: SpeculativeConfig,
    *,
    batch_size: int = 1,
    budget_s: float = 30.0,
) -> Activation:
    """Measure (under auto), decide, and return the updated receipt and controller."""
    policy = Policy(config.device_policy.value)
    prior = acceptance_prior(receipt.family)
    hardware = detect(device=device_kind(), dtype=model_dtype(model))
    table: TimingTable | None = None
    measured: Any = None
    if policy is Policy.auto:
        result = calibrate(
            model, head, batch_sizes=(batch_size,), k=config.num_draft_tokens, budget_s=budget_s
        )
        if isinstance(result, TimingTable):
            table = result
            measured = result.at(batch_size)[0]
        else:
            measured = result  # the typed CalibrationError: decide fails closed on it
    decision = decide(measured, policy, prior, hardware=hardware)
    controller = None
    if table is not None:
        controller = ActivationController(table, prior=prior, policy=policy, active=decision.speculate)
    return Activation(with_hardware(receipt, decision), decision, controller)
