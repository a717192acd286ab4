"""The two assessments of a speculative start: native MTP heads and a separate draft model.

Each fills the receipt's fields as it learns them (family, head layout, weights found,
cache plans) and raises `CheckRefusal` at the first rule the checkpoint breaks; what it
returns is the admitted message.
"""

from __future__ import annotations

from ..checkpoint import Checkpoint, HeadScan, head_only, int_setting, scan_heads
from ..config import AUTO_DEPTH, SpeculativeConfig
from ..policy.depth import AUTO_MAX_DEPTH
from ..reasons import RefusalReason
from ..registry import Family, Registry, Support
from ..sidecar import SidecarReport
from .checks import (
    CheckRefusal,
    cache_kinds,
    check_serving,
    check_vocab,
    family_of,
    plan_caches,
    read_model,
    refuse_sidecar,
    vocab_size,
)
from .kv_groups import check_kv_group
from .schema import BatchShape, ServingContext

MAX_HEADS = 64  # more advertised head layers than this is a corrupt config, not a model
MAX_LAYERS = 100_000


def assess_mtp(
    reg: Registry,
    model: str,
    config: SpeculativeConfig,
    context: ServingContext,
    r: dict,
    sidecar: SidecarReport | None = None,
) -> str:
    ckpt = read_model(model, "model")
    r["model_type"] = ckpt.model_type
    r["quantized_weights"] = ckpt.quantized
    r["vocab_size"] = vocab_size(ckpt)
    refuse_sidecar(reg, ckpt, "model")
    family = family_of(reg, ckpt, "model")
    r.update(family=family.name, family_support=family.support, head_module=family.head_module)
    r.update(validated=family.validated, concat=family.concat, norm_repair=family.norm_repair)
    r.update(chain=family.chain, quantized_matmul=family.quantized_matmul)
    kinds = cache_kinds(family, ckpt)
    if family.support is Support.refused:
        assert family.refusal is not None
        raise CheckRefusal(family.refusal, family.message)
    if family.support is Support.no_mtp:
        raise CheckRefusal(
            RefusalReason.unsupported_model,
            f"model_type {ckpt.model_type!r} ({family.name}) has no native MTP head; "
            "use method = draft_model or none",
        )
    r["batch_shape"] = BatchShape.batched if family.batch_reshape else BatchShape.singleton
    key, heads, layers = _advertised_heads(ckpt, family)
    r["head_count"] = heads
    scan = scan_heads(ckpt, family, heads, layers)
    _admit_head_weights(ckpt, scan, sidecar, f"{heads} MTP head layer(s) ({key})", r)
    if ckpt.quantized and not family.quantized_matmul:
        raise CheckRefusal(
            RefusalReason.unsupported_quantization, f"{family.name} heads cannot run on quantized weights"
        )
    check_serving(reg, family, kinds, context, "model")
    check_kv_group(ckpt, context, "model")
    plan_caches(reg, kinds, context, r)
    r["max_depth"] = AUTO_MAX_DEPTH  # every runnable head chains (spec/families.toml `chain`)
    where = f"the validated sidecar {sidecar.path}" if sidecar is not None else ", ".join(scan.files)
    layers = f"{heads} layer(s)"
    if heads > 1:
        layers += f" (draft step i runs layer min(i, {heads - 1}))"
    return (
        f"mtp admitted: {family.name} head, {layers}, {r['weight_count']} tensors in "
        f"{where}; depth {_depth_text(config, r)}"
    )


def _advertised_heads(ckpt: Checkpoint, family: Family) -> tuple[str | None, int, int]:
    """(config key, head layers, main layers) the config advertises; refused when absent."""
    key, heads, problem = int_setting(ckpt.config, family.head_count_keys, 0, MAX_HEADS)
    if problem:
        raise CheckRefusal(RefusalReason.invalid_config, f"config.json: {problem}")
    if key is None and family.head_count_default:  # the family's configs do not write it
        key, heads = f"{' / '.join(family.head_count_keys)} (absent: default)", family.head_count_default
    if not heads:
        shown = key or " / ".join(family.head_count_keys)
        raise CheckRefusal(
            RefusalReason.unsupported_model, f"config.json advertises no MTP head ({shown} is absent or 0)"
        )
    layers = 0
    assert family.weights is not None
    if family.weights.uses_layer_count:
        _, value, problem = int_setting(ckpt.config, family.layer_count_keys, 1, MAX_LAYERS)
        if problem or value is None:
            raise CheckRefusal(
                RefusalReason.invalid_config,
                f"config.json: {problem or ' / '.join(family.layer_count_keys) + ' is absent'} "
                "(needed to locate the head layers)",
            )
        layers = value
    return key, heads, layers


def _admit_head_weights(
    ckpt: Checkpoint, scan: HeadScan, sidecar: SidecarReport | None, advertised: str, r: dict
) -> None:
    """The head's tensors are there (in the checkpoint, or a validated sidecar pack)."""
    r.update(head_format=scan.head_format, weights_present=scan.present, weight_count=scan.weight_count)
    r.update(layer_weight_counts=scan.layer_counts, missing_weights=scan.missing, head_files=scan.files)
    if head_only(ckpt, scan):
        raise CheckRefusal(
            RefusalReason.unvalidated_sidecar,
            "model: every tensor is a head tensor (an MTP-only sidecar checkpoint, not a model)",
        )
    if sidecar is not None:  # the head comes from a pack: only its contract admits it
        r["sidecar"] = sidecar
        if not sidecar.validated:
            message = f"sidecar {sidecar.path}: {sidecar.failure}"
            raise CheckRefusal(RefusalReason.unvalidated_sidecar, message)
        r.update(validated=True, head_format="hf", weights_present=True, head_files=list(sidecar.files))
        r.update(missing_weights=[], weight_count=sidecar.tensor_count)
    elif not scan.present:
        shown = ", ".join(scan.missing[:4]) + (" ..." if len(scan.missing) > 4 else "")
        raise CheckRefusal(
            RefusalReason.missing_head_weights,
            f"config advertises {advertised} but the weights lack {shown}; "
            "mlx-lm conversions drop head tensors: convert from the original checkpoint",
        )


def assess_draft(
    reg: Registry, model: str, config: SpeculativeConfig, context: ServingContext, r: dict
) -> str:
    assert config.draft_model is not None  # speculative_config guarantees it
    target = read_model(model, "model")
    r["model_type"] = target.model_type
    r["quantized_weights"] = target.quantized
    r["vocab_size"] = vocab_size(target)
    refuse_sidecar(reg, target, "model")
    draft = read_model(config.draft_model, "draft model")
    r["draft_vocab_size"] = vocab_size(draft)
    refuse_sidecar(reg, draft, "draft model")
    family = family_of(reg, target, "model")
    # the draft sits in the head slot with trimmable KV caches only (checked below): rows batch
    r.update(family=family.name, family_support=family.support, batch_shape=BatchShape.batched)
    draft_family = family_of(reg, draft, "draft model")
    r["draft_family"] = draft_family.name
    kinds = cache_kinds(family, target)
    kinds += [k for k in cache_kinds(draft_family, draft) if k not in kinds]
    check_vocab(model, config.draft_model, r)
    for kind in cache_kinds(draft_family, draft):
        if reg.rollback(kind, context.quantized_kv, context.chunked_prefill).strategy != "trim":
            raise CheckRefusal(
                RefusalReason.unsupported_cache_sharing,
                f"draft model cache kind {kind!r}: in the head slot only trimmable KV caches roll back",
            )
    check_serving(reg, family, cache_kinds(family, target), context, "model")
    check_kv_group(target, context, "model")  # the target's cache is the one quantized
    check_serving(reg, draft_family, cache_kinds(draft_family, draft), context, "draft model")
    plan_caches(reg, kinds, context, r)
    r["max_depth"] = AUTO_MAX_DEPTH
    return (
        f"draft_model admitted: {draft_family.name} drafts for {family.name}; depth {_depth_text(config, r)}"
    )


def _depth_text(config: SpeculativeConfig, r: dict) -> str:
    if config.num_draft_tokens == AUTO_DEPTH:
        return f"auto (1..{r['max_depth']}, chosen live from measurement)"
    return str(config.num_draft_tokens)
