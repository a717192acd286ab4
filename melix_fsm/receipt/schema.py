"""The receipt's types, its byte-stable JSON and its JSON Schema (spec/receipt.schema.json).

A test rebuilds the schema with `schema_json()` and fails when the committed file is
stale; changing a field means bumping SCHEMA_ID.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..config import DevicePolicy, Method, Sources
from ..policy.decision import HardwareDecision, HardwareGate
from ..policy.depth import DepthDecision
from ..reasons import RefusalReason
from ..registry import Chain, Concat, NormRepair, Support
from ..sidecar import SidecarReport
from ..spec import spec_dir

SCHEMA_ID = "melix-fsm/receipt/4"


class Mode(enum.StrEnum):
    accepted = "accepted"  # speculation admitted
    legacy_only = "legacy_only"  # the operator chose plain decode (method none / force_off)
    refused = "refused"  # speculation was asked for and refused with a typed reason


class BatchShape(enum.StrEnum):
    batched = "batched"  # per-row state survives extend/filter: speculate in any batch
    singleton = "singleton"  # speculate only while the batch holds this one row


class ServingContext(msgspec.Struct, frozen=True, kw_only=True):
    """Serving facts the rollback matrix depends on (not operator speculative settings)."""

    quantized_kv: bool = False
    chunked_prefill: bool = False
    batched: bool = False  # rows are merged into batch caches (several prompts, a server)
    kv_group_size: int | None = None  # with quantized_kv: must divide the head dim (receipt.kv_groups)


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

    def to_json(self) -> bytes:
        """The receipt as indented, byte-stable JSON (`receipt_json`)."""
        return receipt_json(self)

    def to_dict(self) -> dict[str, Any]:
        """The receipt as plain JSON-ready data (what `--json` and the server print)."""
        return msgspec.to_builtins(self)

    @property
    def speculates(self) -> bool:
        """Does this receipt let the run speculate (admitted, and the hardware gate did not close)?"""
        return self.mode is Mode.accepted and self.refusal_reason is None


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
