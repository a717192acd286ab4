"""The quantized KV cache's group size against the checkpoint's attention head dim.

Rules of this module:
- mlx quantizes a KV cache along each head's last axis in groups of `kv_group_size`, so
  the group must divide the head dim; otherwise the first quantizing step fails inside
  mlx. This check reads config.json only, so the start is refused (typed
  `unsupported_quantization`) before any weight is read.
- The head dim is the config's `head_dim`, else `hidden_size / num_attention_heads` (how
  mlx-lm's attention layers size their heads), nested under text_config for VL
  wrappers. A config that gives neither is not checked here: mlx reports it at the
  first quantizing step.
"""

from __future__ import annotations

from ..checkpoint import Checkpoint, int_setting
from ..reasons import RefusalReason
from .checks import CheckRefusal
from .schema import ServingContext

LIMIT = 1 << 20  # far above any head dim / width; out-of-range values are not read as facts


def _setting(ckpt: Checkpoint, name: str) -> int | None:
    _, value, _ = int_setting(ckpt.config, (f"text_config.{name}", name), 1, LIMIT)
    return value


def head_dim(ckpt: Checkpoint) -> int | None:
    """The attention head dim config.json gives, or None when it does not say."""
    explicit = _setting(ckpt, "head_dim")
    if explicit is not None:
        return explicit
    hidden, heads = _setting(ckpt, "hidden_size"), _setting(ckpt, "num_attention_heads")
    if hidden is None or heads is None or hidden % heads:
        return None
    return hidden // heads


def check_kv_group(ckpt: Checkpoint, context: ServingContext, role: str) -> None:
    """Refuse a quantized KV cache whose group size does not divide the head dim."""
    group = context.kv_group_size
    if not context.quantized_kv or group is None:
        return
    dim = head_dim(ckpt)
    if dim is not None and dim % group:
        raise CheckRefusal(
            RefusalReason.unsupported_quantization,
            f"{role}: kv_group_size {group} does not divide the attention head dim {dim}; "
            "mlx quantizes each head's keys and values in groups along it",
        )
