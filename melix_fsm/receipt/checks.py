"""The checks `resolve` is built from: each reads headers or config values and either
records a fact or stops the assessment with a typed `CheckRefusal`.

`CheckRefusal` never escapes the package: `resolve` turns it into the receipt's refusal.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint import Checkpoint, int_setting, read_checkpoint, sidecar_marker, tokenizer_vocab
from ..errors import CheckpointError, MelixError
from ..reasons import RefusalReason
from ..registry import Family, Registry
from .schema import CachePlan, ServingContext


class CheckRefusal(MelixError):
    """Stops the receipt's assessment with a typed reason; shared by the receipt package's
    checks and caught by `resolve`, which turns it into a refused receipt (it never escapes)."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def read_model(path: str, role: str) -> Checkpoint:
    try:
        return read_checkpoint(path)
    except CheckpointError as exc:
        raise CheckRefusal(RefusalReason.unreadable_checkpoint, f"{role}: {exc}") from None


def family_of(reg: Registry, ckpt: Checkpoint, role: str) -> Family:
    if not ckpt.model_types:
        raise CheckRefusal(RefusalReason.invalid_config, f"{role}: config.json has no model_type string")
    for model_type in ckpt.model_types:
        family = reg.family_for(model_type)
        if family is not None:
            return family
    raise CheckRefusal(
        RefusalReason.unsupported_model,
        f"{role}: model_type {ckpt.model_type!r} is not in the family registry (spec/families.toml)",
    )


def refuse_sidecar(reg: Registry, ckpt: Checkpoint, role: str) -> None:
    marker = sidecar_marker(ckpt.config, reg.sidecar)
    if marker is not None:
        raise CheckRefusal(
            RefusalReason.unvalidated_sidecar,
            f"{role}: {marker}; assistant/MTP-only sidecar checkpoints are not validated",
        )


def check_serving(
    reg: Registry, family: Family, kinds: list[str], context: ServingContext, role: str
) -> None:
    """Refuse a serving context the family's caches cannot run at all (speculating or not)."""
    if context.quantized_kv and not family.quantized_kv_cache:
        raise CheckRefusal(
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
            raise CheckRefusal(blocked.refusal, f"{role}: batched cache kind {kind!r}: {blocked.message}")


def plan_caches(reg: Registry, kinds: list[str], context: ServingContext, r: dict[str, Any]) -> None:
    plans = []
    for kind in kinds:
        cell = reg.rollback(kind, context.quantized_kv, context.chunked_prefill)
        plans.append(CachePlan(kind=kind, strategy=cell.strategy, refusal=cell.refusal))
    r["caches"] = plans
    for kind, plan in zip(kinds, plans):
        if plan.refusal is not None:
            cell = reg.rollback(kind, context.quantized_kv, context.chunked_prefill)
            raise CheckRefusal(plan.refusal, f"cache kind {kind!r}: {cell.message}")


def cache_kinds(family: Family, ckpt: Checkpoint) -> list[str]:
    kinds = list(family.cache_kinds)
    if family.sliding_layer_types and ckpt.sliding_window and "rotating" not in kinds:
        kinds.append("rotating")  # mlx-lm's model gives the config's sliding layers a window
    return kinds


def vocab_size(ckpt: Checkpoint) -> int | None:
    _, value, _ = int_setting(ckpt.config, ("text_config.vocab_size", "vocab_size"), 1, 2**31)
    return value


def check_vocab(model: str, draft_model: str, r: dict) -> None:
    try:
        target_vocab, draft_vocab = tokenizer_vocab(model), tokenizer_vocab(draft_model)
    except CheckpointError as exc:
        raise CheckRefusal(RefusalReason.unreadable_checkpoint, f"tokenizer: {exc}") from None
    for vocab, where in ((target_vocab, model), (draft_vocab, draft_model)):
        if vocab is None:
            raise CheckRefusal(
                RefusalReason.vocab_mismatch,
                f"{where} has no tokenizer.json or tokenizer.model: a shared vocabulary cannot be proven",
            )
    assert target_vocab is not None and draft_vocab is not None
    if target_vocab.source != draft_vocab.source or target_vocab.digest != draft_vocab.digest:
        raise CheckRefusal(
            RefusalReason.vocab_mismatch,
            f"tokenizers differ (target {target_vocab.source} {target_vocab.digest[:12]}, "
            f"draft {draft_vocab.source} {draft_vocab.digest[:12]})",
        )
    t_size, d_size = r["vocab_size"], r["draft_vocab_size"]
    if t_size is None or d_size is None:
        raise CheckRefusal(RefusalReason.invalid_config, "config.json vocab_size is absent or invalid")
    # Embedding rows padded past the tokenizer (Qwen 0.5B vs 7B) are harmless: ids agree.
    if t_size != d_size and min(t_size, d_size) < target_vocab.size:
        raise CheckRefusal(
            RefusalReason.vocab_mismatch,
            f"vocab_size {t_size} (target) vs {d_size} (draft), and the smaller one does not cover "
            f"the tokenizer's {target_vocab.size} ids",
        )
