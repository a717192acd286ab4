"""The capability receipt: one versioned record per speculative start, before any weight loads.

Rules of this package:
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

Modules: `schema` (the types, JSON and JSON Schema), `checks` (the typed `CheckRefusal` and the
checks it is raised from), `assessment` (native MTP heads or a draft model), `resolution`
(`resolve`, `serving_refusal`), `hardware` (`with_hardware`). The family, rollback and
sidecar rules it applies live in melix_fsm.registry and melix_fsm.sidecar.
"""

from .hardware import with_hardware
from .resolution import resolve, serving_refusal
from .schema import (
    SCHEMA_ID,
    BatchShape,
    CachePlan,
    HardwareGate,
    Mode,
    Receipt,
    ServingContext,
    receipt_json,
    schema_json,
    schema_path,
)

__all__ = [
    "SCHEMA_ID",
    "BatchShape",
    "CachePlan",
    "HardwareGate",
    "Mode",
    "Receipt",
    "ServingContext",
    "receipt_json",
    "resolve",
    "schema_json",
    "schema_path",
    "serving_refusal",
    "with_hardware",
]
