"""`resolve`, the one producer of a `Receipt`, and `serving_refusal` for plain decode.

`resolve` always returns a receipt (a refusal is a typed field, never an exception) and
drives the row's lifecycle machine from `requested` with ADMIT or REFUSE.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import AUTO_DEPTH, DevicePolicy, Method, SpeculativeConfig
from ..lifecycle import ADMIT, Event, SequenceMachine, Signal
from ..policy.depth import AUTO_MAX_DEPTH
from ..reasons import RefusalReason
from ..registry import registry
from ..sidecar import SidecarReport
from .assessment import assess_draft, assess_mtp
from .checks import CheckRefusal, cache_kinds, check_serving, family_of, read_model
from .kv_groups import check_kv_group
from .schema import Mode, Receipt, ServingContext


def _blank(model: str, config: SpeculativeConfig, context: ServingContext) -> dict[str, Any]:
    return {
        "model": model,
        "requested_method": config.method,
        "source": config.sources,
        "num_draft_tokens": config.num_draft_tokens,
        "draft_model": config.draft_model,
        "device_policy": config.device_policy,
        "family": None,
        "model_type": None,
        "family_support": None,
        "head_module": None,
        "validated": False,
        "head_count": 0,
        "head_format": None,
        "weights_present": False,
        "weight_count": 0,
        "layer_weight_counts": [],
        "missing_weights": [],
        "head_files": [],
        "concat": None,
        "norm_repair": None,
        "chain": None,
        "quantized_weights": False,
        "quantized_matmul": False,
        "quantized_kv": context.quantized_kv,
        "chunked_prefill": context.chunked_prefill,
        "batched": context.batched,
        "caches": [],
        "batch_shape": None,
        "draft_family": None,
        "vocab_size": None,
        "draft_vocab_size": None,
        "operator_override": config.device_policy is not DevicePolicy.auto,
    }


def _effective_depth(config: SpeculativeConfig, max_depth: int) -> int:
    """Draft tokens per cycle: the fixed k, or under auto the most the controller may pick."""
    return max_depth if config.num_draft_tokens == AUTO_DEPTH else int(config.num_draft_tokens)


def resolve(
    model_dir: str | os.PathLike[str],
    config: SpeculativeConfig | None = None,
    *,
    context: ServingContext | None = None,
    machine: SequenceMachine | None = None,
    sidecar: SidecarReport | None = None,
) -> Receipt:
    """Decide one speculative start and drive its lifecycle machine from `requested`.

    `sidecar` is the contract report of an MTP pack offered for this target
    (melix_fsm.sidecar; melix_mlx.loading.sidecar runs the checks): the head then comes from the
    pack, admitted only when every check passed, else refused as `unvalidated_sidecar`.

    `machine` is the row's machine (a fresh one is made when omitted); it must be in the
    `requested` state, else `IllegalTransition` is raised and nothing is decided.
    """
    config = config if config is not None else SpeculativeConfig()
    context = context if context is not None else ServingContext()
    model = os.fspath(model_dir)
    machine = machine if machine is not None else SequenceMachine(model)
    machine.plan(ADMIT)  # fail fast on a machine that is not in `requested`
    reg = registry()
    r = _blank(model, config, context)
    refusal: CheckRefusal | None = None
    admitted_message = ""
    try:
        if config.method is Method.draft_model:
            admitted_message = assess_draft(reg, model, config, context, r)
        else:  # none and force_off still assess, so the receipt shows what was declined
            admitted_message = assess_mtp(reg, model, config, context, r, sidecar)
    except CheckRefusal as exc:
        refusal = exc
    operator_off = config.method is Method.none or config.device_policy is DevicePolicy.force_off
    readable = refusal is None or refusal.reason is not RefusalReason.unreadable_checkpoint
    if operator_off and readable:
        why = "method = none" if config.method is Method.none else "device_policy = force_off"
        finding = f" (capability finding: {refusal.reason.value}: {refusal.message})" if refusal else ""
        mode, reason, message = (
            Mode.legacy_only,
            RefusalReason.operator_disabled,
            f"{why}: plain decode{finding}",
        )
    elif refusal is not None:
        mode, reason, message = Mode.refused, refusal.reason, refusal.message
    else:
        mode, reason, message = Mode.accepted, None, admitted_message + "; hardware gate not evaluated"
    if reason is None:
        machine.send(ADMIT)
    else:
        machine.send(Signal(event=Event("refuse"), reason=f"{reason.value}: {message}"))
    resolved = config.method if mode is Mode.accepted else Method.none
    max_depth = r.pop("max_depth", AUTO_MAX_DEPTH)
    return Receipt(
        **r,
        resolved_method=resolved,
        mode=mode,
        lifecycle_state=machine.state.value,
        effective_depth=_effective_depth(config, max_depth) if mode is Mode.accepted else 0,
        refusal_reason=reason,
        message=message,
    )


def serving_refusal(
    model_dir: str | os.PathLike[str], context: ServingContext
) -> tuple[RefusalReason, str] | None:
    """Why the model cannot serve `context` even decoding plainly, or None (reads no tensor)."""
    reg = registry()
    try:
        ckpt = read_model(os.fspath(model_dir), "model")
        try:
            family = family_of(reg, ckpt, "model")
        except CheckRefusal:  # not in the registry: only mlx's own limits apply
            family = None
        if family is not None:
            check_serving(reg, family, cache_kinds(family, ckpt), context, "model")
        check_kv_group(ckpt, context, "model")  # any family: mlx cannot quantize it
    except CheckRefusal as exc:
        if exc.reason in (RefusalReason.unsupported_quantization,):
            return exc.reason, exc.message
    return None
