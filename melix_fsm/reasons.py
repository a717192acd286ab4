"""The typed refusal vocabulary shared by the registry, the rollback matrix and receipts.

Rules of this module:
- A refusal is one of these names, never free text; the free-text detail goes into the
  receipt's `message`. Spec files (spec/families.toml, spec/rollback.toml) may only name
  members of this enum, and the loader refuses anything else.
- Adding a reason is adding a member here; removing or renaming one is a receipt schema
  change (bump the schema id in melix_fsm.receipt).
- Refusals found at runtime (by a decoder that sees the loaded model, sampler and caches)
  travel as text `"<reason>: <detail>"` (`refusal_text`); `reason_of` reads the typed
  reason back, so statistics carry a `RefusalReason`, not only prose.
"""

from __future__ import annotations

import enum


class RefusalReason(enum.StrEnum):
    """Why speculation was not admitted."""

    missing_head_weights = "missing_head_weights"  # config advertises heads the weights lack
    head_shape_mismatch = "head_shape_mismatch"  # a head tensor's shape fits another model
    unsupported_model = "unsupported_model"  # family has no head we run (or no head at all)
    unvalidated_sidecar = "unvalidated_sidecar"  # assistant / MTP-only checkpoint offered
    unsupported_cache_sharing = "unsupported_cache_sharing"  # a cache kind has no exact rollback
    unsupported_quantization = "unsupported_quantization"  # a quantized cache (or head) we cannot run
    device_policy_disabled = "device_policy_disabled"  # the measured device policy said off
    invalid_config = "invalid_config"  # config.json values are out of range or mistyped
    vocab_mismatch = "vocab_mismatch"  # draft and target do not share a vocabulary
    operator_disabled = "operator_disabled"  # method none or device policy force_off
    unreadable_checkpoint = "unreadable_checkpoint"  # a file is missing, unreadable or corrupt
    unsupported_sampler = "unsupported_sampler"  # a sampler whose distribution cannot be verified
    unsupported_sharding = "unsupported_sharding"  # mlx-lm cannot shard it over this group


def refusal_text(reason: RefusalReason, detail: str) -> str:
    """A runtime refusal as text that keeps its typed reason first."""
    return f"{reason.value}: {detail}"


def reason_of(text: str | None) -> RefusalReason | None:
    """The typed reason a `refusal_text` starts with (None for no refusal or free text)."""
    if not text:
        return None
    head = text.split(":", 1)[0].strip()
    return RefusalReason.__members__.get(head)
