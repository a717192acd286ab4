"""Device-policy evaluation of a loaded model: measure, decide, update the receipt.

Rules of this module:
- Runs after the weights are loaded and before any prompt is served (timings taken beside
  a prefill would poison the decision). Under `auto` it calibrates at the batch size
  that will be served (at the deepest depth `num_draft_tokens = "auto"` may choose) and
  at the context the run's caches will hold when the caller knows it (`generate`: the
  longest prompt plus half the tokens to generate); `force_on` / `force_off` skip the
  measurement and are recorded as operator overrides.
- Every start gets a `LiveController` (melix_fsm.policy.controller), and the decoders consult it
  every step. The calibration is only its prior: the gate in the receipt is the first
  decision, then the controller compares measured speculative and plain tokens/s live.
- Fail closed, consistently: a calibration that fails (or never ran) under `auto` gives a
  DISABLED controller, which never speculates, and the receipt says
  `device_policy_disabled` with the failure's reason. A decoder must never read "no
  controller" as "speculate": there is always one.
- The cost model prices every forward a cycle runs: recurrent layers the engine cannot
  capture inside the verify are restored and replayed after a rejection
  (`replays_on_reject`), one more forward on every rejecting cycle.
- Under mx.distributed (`group`), the calibration is rank 0's (calibrate.agree) and so is
  every live decision: the controller's `agree` hook broadcasts rank 0's (speculating, k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec

from melix_fsm.config import AUTO_DEPTH, SpeculativeConfig
from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.cost_model import CycleForwards, TimingTable, acceptance_prior, replay_rate
from melix_fsm.policy.decision import HardwareDecision, Policy, decide
from melix_fsm.policy.live_types import Decision, LiveConfig
from melix_fsm.policy.telemetry import detect
from melix_fsm.receipt import Receipt, with_hardware

from ..runtime.calibrate import PROMPT_LEN, calibrate, device_kind, model_dtype

MAX_CONTEXT = 2048  # the longest context calibration prefills (B rows of it, within the budget)


@dataclass
class Activation:
    receipt: Receipt
    decision: HardwareDecision
    controller: LiveController  # always one: disabled, forced, or live

    @property
    def k(self) -> int:
        """The depth the first cycle drafts (the controller's `k`; auto depth moves it)."""
        return self.controller.k


def draft_budget(config: SpeculativeConfig, controller: LiveController | None) -> int:
    """The drafts a decoder builds its rows for: the deepest k the controller may choose
    (its depth's `max_k`: the fixed k, or auto's ceiling), else the configured k (1 for
    auto without a controller, which then never speculates). The one place `auto` turns
    into a number for the decoders."""
    if controller is not None:
        return controller.depth.max_k
    k = config.num_draft_tokens
    return 1 if k == AUTO_DEPTH else int(k)


def evaluate(
    model: nn.Module,
    head: Any,
    receipt: Receipt,
    config: SpeculativeConfig,
    *,
    batch_size: int = 1,
    budget_s: float = 30.0,
    replay_on_reject: bool | None = None,
    live: LiveConfig | None = None,
    group: Any = None,
    context: int | None = None,
    cache: Any = None,
) -> Activation:
    """Measure (under auto), decide, and return the updated receipt and the controller.

    replay_on_reject: whether the decoder re-runs kept tokens after a rejection on
    recurrent caches (None: `replays_on_reject(model)`). group: an mx.distributed group.
    context: tokens the run's caches will hold (e.g. the longest prompt plus half the
    tokens to generate): attention costs grow with it, so the prior prices the run's own
    forwards. Capped at MAX_CONTEXT (the budget prefills it B times); None: a short prompt.
    cache: a melix_mlx.decoding.calibration_cache.CalibrationCache to reuse a stored
    calibration of this model on this machine from (one process only: ranks of a group
    always measure together); the receipt's hardware detail says when it did.
    """
    if group is None:  # a model sharded by melix_mlx.runtime.distributed carries its group
        from ..runtime.distributed import group_of

        group = group_of(model)
    policy = Policy(config.device_policy.value)
    prior = acceptance_prior(receipt.family)
    hardware = detect(device=device_kind(), dtype=model_dtype(model))
    auto_depth = config.num_draft_tokens == AUTO_DEPTH
    max_k = max(1, receipt.effective_depth) if auto_depth else int(config.num_draft_tokens)
    if replay_on_reject is None:
        replay_on_reject = replays_on_reject(model)
    measured: Any = None  # a TimingTable, or the typed CalibrationError the controller disables on
    reused = None
    if policy is Policy.auto:
        measured, reused = _measure(model, head, receipt, batch_size, max_k, budget_s, group, context, cache)
    table = measured if isinstance(measured, TimingTable) else None

    def controller_for(active: bool | None = None) -> LiveController:
        return LiveController(
            measured,
            prior=prior,
            policy=policy,
            depth=AUTO_DEPTH if auto_depth else max_k,
            max_depth=max_k,
            batch_size=batch_size,
            active=active,
            replay_on_reject=replay_on_reject,
            config=live,
            agree=rank0_decision(group),
        )

    controller = controller_for()
    gate_input: Any = measured
    forwards = None
    if table is not None:
        # the gate prices the depth the run starts with, replay included
        k = controller.depth.chosen
        gate_input = table.at(batch_size, k)[0]
        replay = replay_rate(prior.acceptance, k, batch_size) if replay_on_reject else 0.0
        forwards = CycleForwards(replay=replay)
    decision = decide(gate_input, policy, prior, hardware=hardware, forwards=forwards)
    if reused is not None:  # the receipt says the figures are a stored calibration's
        detail = f"{decision.detail}; " if decision.detail else ""
        decision = msgspec.structs.replace(decision, detail=f"{detail}timings reused from {reused}")
    if table is not None and controller.speculating != decision.speculate:
        # one verdict: the controller starts where the receipt's gate says
        controller = controller_for(active=decision.speculate)
    receipt = with_hardware(receipt, decision, depth=controller.depth_decision)
    return Activation(receipt, decision, controller)


def _measure(
    model: nn.Module,
    head: Any,
    receipt: Receipt,
    batch_size: int,
    k: int,
    budget_s: float,
    group: Any,
    context: int | None,
    cache: Any,
) -> tuple[Any, Path | None]:
    """Calibrate at the run's batch size, depth and context (a stored calibration where
    `cache` holds one: one process only, ranks of a group always measure together).
    Returns (TimingTable or CalibrationError, where reused figures came from or None)."""
    tokens = PROMPT_LEN if context is None else max(PROMPT_LEN, min(context, MAX_CONTEXT))

    def measure(tokens: int) -> Any:
        return calibrate(
            model, head, batch_sizes=(batch_size,), k=k, budget_s=budget_s, group=group, context=tokens
        )

    if cache is not None and (group is None or group.size() == 1):
        key = calibration_key(model, head, receipt, batch_size=batch_size, k=k, context=tokens)
        return cache.fetch(key, measure)
    return measure(tokens), None


def calibration_key(
    model: nn.Module, head: Any, receipt: Receipt, *, batch_size: int, k: int, context: int
) -> dict[str, Any]:
    """What a stored calibration of this model must match (calibration_cache.key_of),
    with the context bucketed as the cache measures it."""
    from .calibration_cache import bucket, key_of

    head_kind = (
        f"{type(head).__name__}:{receipt.head_count}:{receipt.head_format}:{receipt.sidecar is not None}"
    )
    return key_of(
        receipt.model,
        dtype=model_dtype(model),
        head=head_kind,
        batch_size=batch_size,
        k=k,
        context=bucket(context, PROMPT_LEN, MAX_CONTEXT),
    )


def replays_on_reject(model: nn.Module) -> bool:
    """Does a rejecting cycle cost one more target forward (a replay) on this model?

    The cycle engine (melix_mlx.runtime.engine) captures recurrent state inside the verify where
    every recurrent layer has a capturing twin (melix_mlx.runtime.capture); only the rest restore
    and replay. The same test as the engine's, so the cost model prices what runs. It
    installs the capturing layers the decoders install anyway (idempotent; parameters
    and unarmed behaviour unchanged), so the answer does not depend on call order.
    """
    from mlx_lm.models.cache import make_prompt_cache

    from ..runtime import capture, rollback

    cache = make_prompt_cache(model)
    if not rollback.needs_replay(cache):
        return False
    capture.install(model)
    return not capture.supported(model, cache)


def rank0_decision(group: Any = None) -> Callable[[Decision], Decision] | None:
    """The live controller's `agree` hook: every rank adopts rank 0's (speculating, k).

    Called by the controller on every rank at every update, so the all_sum below always
    has every rank in it; values off rank 0 are zeros. None in a single process.
    """
    if group is None or group.size() == 1:
        return None
    rank0 = group.rank() == 0

    def agree(own: Decision) -> Decision:
        values = [float(v) if rank0 else 0.0 for v in own.as_ints()]
        summed = mx.distributed.all_sum(mx.array(values, dtype=mx.float32), group=group).tolist()
        return Decision.from_ints(summed)

    return agree
