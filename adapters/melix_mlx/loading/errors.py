"""Typed errors raised while finding and loading MTP head weights.

Rules:
- Every failure to produce a usable head is a ``HeadLoadError`` subclass carrying its
  ``reason``, a ``RefusalReason`` (melix_fsm.reasons), so callers put it in a receipt as is.
- These are raised before any decoding starts; nothing falls back silently.
- They belong to the package's one error tree (melix_fsm.errors.MelixError).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from melix_fsm.errors import MelixError
from melix_fsm.reasons import RefusalReason


class HeadLoadError(MelixError):
    """Base class: the checkpoint cannot give a usable MTP head."""

    reason: RefusalReason = RefusalReason.unsupported_model

    def __init__(self, message: str, *, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = dict(details or {})


class MissingHeadWeights(HeadLoadError):
    """The config advertises an MTP head but (some of) its tensors are absent."""

    reason = RefusalReason.missing_head_weights


class HeadShapeMismatch(HeadLoadError):
    """A head tensor has the wrong shape (corrupt file, or a head for another model)."""

    reason = RefusalReason.head_shape_mismatch


class UnsupportedModel(HeadLoadError):
    """The model family (or its config) is not one this package knows how to head."""

    reason = RefusalReason.unsupported_model


class UnsupportedServing(MelixError):
    """A serving option (e.g. a quantized KV cache in a batch) that cannot run exactly.

    `reason` is the typed `RefusalReason` the registry gives that combination.
    """

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message


def batched_quantized_kv() -> UnsupportedServing:
    """The registry's refusal of a quantized KV cache in a batch (spec/rollback.toml)."""
    from melix_fsm.registry import registry

    blocked = registry().unmergeable["quantized_kv"]
    return UnsupportedServing(blocked.refusal, f"batched cache kind 'quantized_kv': {blocked.message}")


def check_batch_form(cache: list[Any], kind_of: Callable[[Any], str]) -> None:
    """Refuse, typed, a cache class mlx-lm cannot merge into a batch at all (it has no
    `merge`: mlx-lm's own BatchGenerator fails on it at the first join too), before any
    row is admitted. `kind_of`: the registry's name for a cache's kind."""
    from melix_fsm.registry import registry

    for c in cache:
        if hasattr(c, "merge"):
            continue
        kind = kind_of(c)
        blocked = registry().unmergeable.get(kind)
        why = blocked.message if blocked is not None else "mlx-lm has no batch form for it"
        raise UnsupportedServing(
            RefusalReason.unsupported_cache_sharing,
            f"cache {type(c).__name__} (kind {kind!r}) has no batch form in mlx-lm (no merge): {why}; "
            "decode it one sequence at a time",
        )


class UnvalidatedSidecar(HeadLoadError):
    """An MTP sidecar pack failed its validation contract (melix_fsm.sidecar).

    ``report`` names every check and the failed one; ``receipt`` is the refused receipt.
    """

    reason = RefusalReason.unvalidated_sidecar

    def __init__(self, message: str, *, report: object = None, receipt: object = None) -> None:
        super().__init__(message, details={"failed_check": getattr(report, "failed_check", None)})
        self.report = report
        self.receipt = receipt


class InvalidPrompt(MelixError, ValueError):
    """A prompt the model cannot read: empty, or a token id outside its vocabulary.

    Checked before any forward: an out-of-range id would make mlx read past the
    embedding table (garbage output, or a crash) instead of failing.
    """


def check_kv_group(model_args: object, kv_bits: int | None, kv_group_size: int) -> None:
    """Refuse (typed, before any forward) a quantized KV group size that does not divide
    the loaded model's attention head dim, which mlx would only report at the first
    quantizing step. Args that give no head dim are not checked here."""
    if kv_bits is None:
        return
    dim = getattr(model_args, "head_dim", None)
    hidden, heads = getattr(model_args, "hidden_size", None), getattr(model_args, "num_attention_heads", None)
    if not isinstance(dim, int) and isinstance(hidden, int) and isinstance(heads, int) and heads:
        dim = hidden // heads if hidden % heads == 0 else None
    if isinstance(dim, int) and dim % kv_group_size:
        raise UnsupportedServing(
            RefusalReason.unsupported_quantization,
            f"kv_group_size {kv_group_size} does not divide the attention head dim {dim}; "
            "mlx quantizes each head's keys and values in groups along it",
        )
