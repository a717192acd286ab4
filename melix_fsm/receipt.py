"""The capability receipt: one versioned record per speculative start, before any weight loads.
(Over 400 lines: the receipt type and its one producer, `resolve`, read together; the
family, rollback and sidecar rules it applies live in registry.py and sidecar.py.)

Rules of this module:
- `resolve(model_dir, config)` is the only producer of a `Receipt`. It reads config.json,
  safetensors headers and tokenizer files (melix_fsm.checkpoint), consults the registry
  (spec/families.toml, spec/rollback.toml) and never loads a tensor.
- It always returns a receipt: bad input becomes a typed refusal
  (`unreadable_checkpoint`, `invalid_config`, ...), never an exception. A `ConfigError`
  from building the `SpeculativeConfig` happens earlier, in melix_fsm.config.
- The outcome is a lifecycle transition, not a side channel: the receipt drives the row's
  `SequenceMachine` from `requested` with ADMIT or REFUSE and records the state it reached.
- Nothing falls back silently: when speculation does not run, `refusal_reason` says why
  (method none and device policy force_off are `operator_disabled`, mode `legacy_only`).
- The hardware gate belongs to the device policy (melix_fsm.policy.decision). `resolve` runs before
  any weight is loaded, so its receipt says `not_evaluated`; once the model is loaded and
  measured, `with_hardware` returns the same receipt with the gate, the measured figures
  and, when the gate disables speculation, the typed refusal `device_policy_disabled`.
- The receipt's JSON Schema lives in spec/receipt.schema.json; `schema_json()` rebuilds it
  and a test fails when the file is stale. Changing a field means bumping SCHEMA_ID.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Any, Literal

import msgspec

from .checkpoint import (
    Checkpoint,
    head_only,
    int_setting,
    read_checkpoint,
    scan_heads,
    sidecar_marker,
    tokenizer_vocab,
)
from .config import AUTO_DEPTH, DevicePolicy, Method, Sources, SpeculativeConfig
from .errors import CheckpointError
from .lifecycle import ADMIT, Event, SequenceMachine, Signal
from .policy.decision import HardwareDecision
from .policy.depth import AUTO_MAX_DEPTH, DepthDecision
from .reasons import RefusalReason
from .registry import Chain, Concat, Family, NormRepair, Registry, Support, registry
from .sidecar import SidecarReport
from .spec import spec_dir

SCHEMA_ID = "melix-fsm/receipt/3"
MAX_HEADS = 64  # more advertised head layers than this is a corrupt config, not a model
MAX_LAYERS = 100_000


class Mode(enum.StrEnum):
    accepted = "accepted"  # speculation admitted
    legacy_only = "legacy_only"  # the operator chose plain decode (method none / force_off)
    refused = "refused"  # speculation was asked for and refused with a typed reason


class HardwareGate(enum.StrEnum):
    admitted = "admitted"
    disabled = "disabled"
    not_evaluated = "not_evaluated"


class BatchShape(enum.StrEnum):
    batched = "batched"  # per-row state survives extend/filter: speculate in any batch
    singleton = "singleton"  # speculate only while the batch holds this one row


class ServingContext(msgspec.Struct, frozen=True, kw_only=True):
    """Serving facts the rollback matrix depends on (not operator speculative settings)."""

    quantized_kv: bool = False
    chunked_prefill: bool = False
    batched: bool = False  # rows are merged into batch caches (several prompts, a server)


class CachePlan(msgspec.Struct, frozen=True, kw_only=True):
    """How one cache kind of the main (or draft) model is rolled back, or why it cannot be."""

    kind: str
    strategy: str | None
    refusal: RefusalReason | None


class Receipt(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The machine-readable decision for one speculative start."""

    schema: str = SCHEMA_ID
    model: str
    requested_method: Method
    resolved_method: Method
    mode: Mode
    lifecycle_state: str  # the row's lifecycle state after resolution: admitted | refused
    source: Sources
    num_draft_tokens: int | Literal["auto"]
    draft_model: str | None
    device_policy: DevicePolicy
    family: str | None
    model_type: str | None
    family_support: Support | None
    head_module: str | None
    validated: bool  # acceptance checked on a real checkpoint of this family
    head_count: int  # head layers the config advertises
    effective_depth: int  # draft tokens per cycle when speculating (auto: the most), else 0
    head_format: str | None  # "hf" or "melix" (converted by this project)
    weights_present: bool
    weight_count: int
    layer_weight_counts: list[int]
    missing_weights: list[str]
    head_files: list[str]
    concat: Concat | None
    norm_repair: NormRepair | None
    chain: Chain | None
    quantized_weights: bool
    quantized_matmul: bool
    quantized_kv: bool
    chunked_prefill: bool
    batched: bool
    caches: list[CachePlan]
    batch_shape: BatchShape | None
    draft_family: str | None
    vocab_size: int | None
    draft_vocab_size: int | None
    hardware_gate: HardwareGate = HardwareGate.not_evaluated
    hardware: HardwareDecision | None = None  # the device policy's decision and its inputs
    depth: DepthDecision | None = None  # the depth the run starts with (set with the hardware gate)
    sidecar: SidecarReport | None = None  # the contract report of an offered MTP pack
    operator_override: bool
    refusal_reason: RefusalReason | None
    message: str


class _Refusal(Exception):
    """Internal: stops the assessment with a typed reason (never escapes `resolve`)."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


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


def _read(path: str, role: str) -> Checkpoint:
    try:
        return read_checkpoint(path)
    except CheckpointError as exc:
        raise _Refusal(RefusalReason.unreadable_checkpoint, f"{role}: {exc}") from None


def _family(reg: Registry, ckpt: Checkpoint, role: str) -> Family:
    if not ckpt.model_types:
        raise _Refusal(RefusalReason.invalid_config, f"{role}: config.json has no model_type string")
    for model_type in ckpt.model_types:
        family = reg.family_for(model_type)
        if family is not None:
            return family
    raise _Refusal(
        RefusalReason.unsupported_model,
        f"{role}: model_type {ckpt.model_type!r} is not in the family registry (spec/families.toml)",
    )


def _sidecar(reg: Registry, ckpt: Checkpoint, role: str) -> None:
    marker = sidecar_marker(ckpt.config, reg.sidecar)
    if marker is not None:
        raise _Refusal(
            RefusalReason.unvalidated_sidecar,
            f"{role}: {marker}; assistant/MTP-only sidecar checkpoints are not validated",
        )


def _serving(reg: Registry, family: Family, kinds: list[str], context: ServingContext, role: str) -> None:
    """Refuse a serving context the family's caches cannot run at all (speculating or not)."""
    if context.quantized_kv and not family.quantized_kv_cache:
        raise _Refusal(
            RefusalReason.unsupported_quantization,
            f"{role}: {family.name} attention (MLA) reads its cached latent as plain arrays; "
            "it cannot run on a quantized KV cache (drop kv_bits)",
        )
    if not context.batched:
        return
    for kind in kinds:
        kind = "quantized_kv" if context.quantized_kv and kind == "kv" else kind
        blocked = reg.unmergeable.get(kind)
        if blocked is not None:
            raise _Refusal(blocked.refusal, f"{role}: batched cache kind {kind!r}: {blocked.message}")


def serving_refusal(
    model_dir: str | os.PathLike[str], context: ServingContext
) -> tuple[RefusalReason, str] | None:
    """Why the model cannot serve `context` even decoding plainly, or None (reads no tensor)."""
    reg = registry()
    try:
        ckpt = _read(os.fspath(model_dir), "model")
        family = _family(reg, ckpt, "model")
        _serving(reg, family, _cache_kinds(family, ckpt), context, "model")
    except _Refusal as exc:
        if exc.reason in (RefusalReason.unsupported_quantization,):
            return exc.reason, exc.message
    return None


def _caches(reg: Registry, kinds: list[str], context: ServingContext, r: dict[str, Any]) -> None:
    plans = []
    for kind in kinds:
        cell = reg.rollback(kind, context.quantized_kv, context.chunked_prefill)
        plans.append(CachePlan(kind=kind, strategy=cell.strategy, refusal=cell.refusal))
    r["caches"] = plans
    for kind, plan in zip(kinds, plans):
        if plan.refusal is not None:
            cell = reg.rollback(kind, context.quantized_kv, context.chunked_prefill)
            raise _Refusal(plan.refusal, f"cache kind {kind!r}: {cell.message}")


def _cache_kinds(family: Family, ckpt: Checkpoint) -> list[str]:
    kinds = list(family.cache_kinds)
    if ckpt.sliding_window and "rotating" not in kinds:
        kinds.append("rotating")  # the config turns sliding-window layers on
    return kinds


def _vocab_size(ckpt: Checkpoint) -> int | None:
    _, value, _ = int_setting(ckpt.config, ("text_config.vocab_size", "vocab_size"), 1, 2**31)
    return value


def _assess_mtp(
    reg: Registry,
    model: str,
    config: SpeculativeConfig,
    context: ServingContext,
    r: dict,
    sidecar: SidecarReport | None = None,
) -> str:
    ckpt = _read(model, "model")
    r["model_type"] = ckpt.model_type
    r["quantized_weights"] = ckpt.quantized
    r["vocab_size"] = _vocab_size(ckpt)
    _sidecar(reg, ckpt, "model")
    family = _family(reg, ckpt, "model")
    r.update(family=family.name, family_support=family.support, head_module=family.head_module)
    r.update(validated=family.validated, concat=family.concat, norm_repair=family.norm_repair)
    r.update(chain=family.chain, quantized_matmul=family.quantized_matmul)
    kinds = _cache_kinds(family, ckpt)
    if family.support is Support.refused:
        assert family.refusal is not None
        raise _Refusal(family.refusal, family.message)
    if family.support is Support.no_mtp:
        raise _Refusal(
            RefusalReason.unsupported_model,
            f"model_type {ckpt.model_type!r} ({family.name}) has no native MTP head; "
            "use method = draft_model or none",
        )
    r["batch_shape"] = BatchShape.batched if family.batch_reshape else BatchShape.singleton
    key, heads, problem = int_setting(ckpt.config, family.head_count_keys, 0, MAX_HEADS)
    if problem:
        raise _Refusal(RefusalReason.invalid_config, f"config.json: {problem}")
    if not heads:
        shown = key or " / ".join(family.head_count_keys)
        raise _Refusal(
            RefusalReason.unsupported_model, f"config.json advertises no MTP head ({shown} is absent or 0)"
        )
    r["head_count"] = heads
    layers = 0
    assert family.weights is not None
    if family.weights.uses_layer_count:
        lkey, value, problem = int_setting(ckpt.config, family.layer_count_keys, 1, MAX_LAYERS)
        if problem or value is None:
            raise _Refusal(
                RefusalReason.invalid_config,
                f"config.json: {problem or ' / '.join(family.layer_count_keys) + ' is absent'} "
                "(needed to locate the head layers)",
            )
        layers = value
    scan = scan_heads(ckpt, family, heads, layers)
    r.update(head_format=scan.head_format, weights_present=scan.present, weight_count=scan.weight_count)
    r.update(layer_weight_counts=scan.layer_counts, missing_weights=scan.missing, head_files=scan.files)
    if head_only(ckpt, scan):
        raise _Refusal(
            RefusalReason.unvalidated_sidecar,
            "model: every tensor is a head tensor (an MTP-only sidecar checkpoint, not a model)",
        )
    if sidecar is not None:  # the head comes from a pack: only its contract admits it
        r["sidecar"] = sidecar
        if not sidecar.validated:
            raise _Refusal(RefusalReason.unvalidated_sidecar, f"sidecar {sidecar.path}: {sidecar.failure}")
        r.update(validated=True, head_format="hf", weights_present=True, head_files=list(sidecar.files))
        r.update(missing_weights=[], weight_count=sidecar.tensor_count)
    elif not scan.present:
        shown = ", ".join(scan.missing[:4]) + (" ..." if len(scan.missing) > 4 else "")
        raise _Refusal(
            RefusalReason.missing_head_weights,
            f"config advertises {heads} MTP head layer(s) ({key}) but the weights lack {shown}; "
            "mlx-lm conversions drop head tensors: convert from the original checkpoint",
        )
    if family.layout_of is not None and not family.validated:
        raise _Refusal(
            RefusalReason.unvalidated_family,
            f"{family.name} borrows the {family.layout_of} head layout, which is not yet validated "
            "on a real checkpoint of this family",
        )
    if (
        config.num_draft_tokens != AUTO_DEPTH
        and config.num_draft_tokens > heads
        and family.chain is Chain.none
    ):
        raise _Refusal(
            RefusalReason.depth_exceeds_heads,
            f"num_draft_tokens = {config.num_draft_tokens} exceeds the {heads} head layer(s) "
            f"and {family.name} cannot chain its head",
        )
    if ckpt.quantized and not family.quantized_matmul:
        raise _Refusal(
            RefusalReason.unsupported_quantization, f"{family.name} heads cannot run on quantized weights"
        )
    _serving(reg, family, kinds, context, "model")
    _caches(reg, kinds, context, r)
    r["max_depth"] = min(heads, AUTO_MAX_DEPTH) if family.chain is Chain.none else AUTO_MAX_DEPTH
    where = f"the validated sidecar {sidecar.path}" if sidecar is not None else ", ".join(scan.files)
    layers = f"{heads} layer(s)"
    if heads > 1:
        layers += f" (draft step i runs layer min(i, {heads - 1}))"
    return (
        f"mtp admitted: {family.name} head, {layers}, {r['weight_count']} tensors in "
        f"{where}; depth {_depth_text(config, r)}"
    )


def _assess_draft(
    reg: Registry, model: str, config: SpeculativeConfig, context: ServingContext, r: dict
) -> str:
    assert config.draft_model is not None  # speculative_config guarantees it
    target = _read(model, "model")
    r["model_type"] = target.model_type
    r["quantized_weights"] = target.quantized
    r["vocab_size"] = _vocab_size(target)
    _sidecar(reg, target, "model")
    draft = _read(config.draft_model, "draft model")
    r["draft_vocab_size"] = _vocab_size(draft)
    _sidecar(reg, draft, "draft model")
    family = _family(reg, target, "model")
    # the draft sits in the head slot with trimmable KV caches only (checked below): rows batch
    r.update(family=family.name, family_support=family.support, batch_shape=BatchShape.batched)
    draft_family = _family(reg, draft, "draft model")
    r["draft_family"] = draft_family.name
    kinds = _cache_kinds(family, target)
    kinds += [k for k in _cache_kinds(draft_family, draft) if k not in kinds]
    _check_vocab(model, config.draft_model, r)
    for kind in _cache_kinds(draft_family, draft):
        if reg.rollback(kind, context.quantized_kv, context.chunked_prefill).strategy != "trim":
            raise _Refusal(
                RefusalReason.unsupported_cache_sharing,
                f"draft model cache kind {kind!r}: in the head slot only trimmable KV caches roll back",
            )
    _serving(reg, family, _cache_kinds(family, target), context, "model")
    _serving(reg, draft_family, _cache_kinds(draft_family, draft), context, "draft model")
    _caches(reg, kinds, context, r)
    r["max_depth"] = AUTO_MAX_DEPTH
    return (
        f"draft_model admitted: {draft_family.name} drafts for {family.name}; depth {_depth_text(config, r)}"
    )


def _depth_text(config: SpeculativeConfig, r: dict) -> str:
    if config.num_draft_tokens == AUTO_DEPTH:
        return f"auto (1..{r['max_depth']}, chosen live from measurement)"
    return str(config.num_draft_tokens)


def _effective_depth(config: SpeculativeConfig, max_depth: int) -> int:
    """Draft tokens per cycle: the fixed k, or under auto the most the controller may pick."""
    return max_depth if config.num_draft_tokens == AUTO_DEPTH else int(config.num_draft_tokens)


def _check_vocab(model: str, draft_model: str, r: dict) -> None:
    try:
        target_vocab, draft_vocab = tokenizer_vocab(model), tokenizer_vocab(draft_model)
    except CheckpointError as exc:
        raise _Refusal(RefusalReason.unreadable_checkpoint, f"tokenizer: {exc}") from None
    for vocab, where in ((target_vocab, model), (draft_vocab, draft_model)):
        if vocab is None:
            raise _Refusal(
                RefusalReason.vocab_mismatch,
                f"{where} has no tokenizer.json or tokenizer.model: a shared vocabulary cannot be proven",
            )
    assert target_vocab is not None and draft_vocab is not None
    if target_vocab.source != draft_vocab.source or target_vocab.digest != draft_vocab.digest:
        raise _Refusal(
            RefusalReason.vocab_mismatch,
            f"tokenizers differ (target {target_vocab.source} {target_vocab.digest[:12]}, "
            f"draft {draft_vocab.source} {draft_vocab.digest[:12]})",
        )
    t_size, d_size = r["vocab_size"], r["draft_vocab_size"]
    if t_size is None or d_size is None:
        raise _Refusal(RefusalReason.invalid_config, "config.json vocab_size is absent or invalid")
    # Embedding rows padded past the tokenizer (Qwen 0.5B vs 7B) are harmless: ids agree.
    if t_size != d_size and min(t_size, d_size) < target_vocab.size:
        raise _Refusal(
            RefusalReason.vocab_mismatch,
            f"vocab_size {t_size} (target) vs {d_size} (draft), and the smaller one does not cover "
            f"the tokenizer's {target_vocab.size} ids",
        )


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
    (melix_fsm.sidecar; melix_mlx.sidecar runs the checks): the head then comes from the
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
    refusal: _Refusal | None = None
    admitted_message = ""
    try:
        if config.method is Method.draft_model:
            admitted_message = _assess_draft(reg, model, config, context, r)
        else:  # none and force_off still assess, so the receipt shows what was declined
            admitted_message = _assess_mtp(reg, model, config, context, r, sidecar)
    except _Refusal as exc:
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


def receipt_json(receipt: Receipt) -> bytes:
    """The receipt as indented JSON with a trailing newline (byte-stable)."""
    return msgspec.json.format(msgspec.json.encode(receipt), indent=2) + b"\n"


def schema_json() -> bytes:
    """The receipt's JSON Schema, as committed in spec/receipt.schema.json."""
    schema = msgspec.json.schema(Receipt)
    schema = {"$id": SCHEMA_ID, "title": "melix-fsm capability receipt", **schema}
    return msgspec.json.format(msgspec.json.encode(schema), indent=2) + b"\n"


def schema_path() -> Path:
    return spec_dir() / "receipt.schema.json"


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
