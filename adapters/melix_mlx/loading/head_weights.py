"""The MTP head's tensors in a checkpoint: where they are, how they are read and checked,
and how one head layer is built from them (melix_mlx.loading builds whole heads and loads
models with them; melix_mlx.loading.sidecar validates packs with the same pieces).

Rules:
- Head tensors are read straight from every ``*.safetensors`` file in the directory,
  including a ``mtp.safetensors`` sidecar that mlx-lm's ``model*.safetensors`` glob skips.
- Two stored formats: raw HF names (family ``from_hf`` mapping: qwen3_5 (1+w) norms get
  +1, deepseek experts stacked / kv_b split / fp8 dequantised), or the converted format
  (``melix_mtp.<param>`` keys, config ``melix_mtp.norms_repaired: true``) loaded as is.
- The main model goes through ``mlx_lm.utils.load_model`` with head tensors removed from
  the weights handed to the family's ``sanitize`` (``load_main``).
- Every failure is a typed ``HeadLoadError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, infer_quant_config, load_config, load_model

from melix_fsm.checkpoint import safetensors_keys

from .errors import HeadShapeMismatch, MissingHeadWeights
from .families import advertised_head_count, detect_family, text_config
from .heads import FAMILY_MODULES, HEAD_CLASSES, MTPHeadBase

MELIX_KEY_PREFIX = "melix_mtp."
MELIX_CONFIG_KEY = "melix_mtp"
MELIX_FORMAT_VERSION = 1
SIDECAR_NAME = "mtp.safetensors"
STACKED_PREFIX = "heads."  # converted multi-layer heads: melix_mtp.heads.{j}.<param>


@dataclass(frozen=True)
class HeadInfo:
    """What was found and done while loading a head (goes into receipts)."""

    family: str
    model_type: str
    advertised_layers: int
    layer_index: int  # the first head layer loaded
    head_layers: int  # head layers loaded and run (draft step i runs layer min(i, head_layers - 1))
    head_format: str  # "hf" (raw upstream names) or "melix" (converted)
    source_files: tuple[str, ...]
    sidecar: bool  # some head tensors came from a file mlx-lm's glob skips
    norms_repaired_on_load: bool  # +1 applied now (qwen3_5 raw HF only)
    head_dtype: str
    head_quantized: bool
    main_quantized: bool
    own_lm_head: bool
    chain_post_norm: bool
    concat_order: str
    num_params: int
    receipt: Any = None  # melix_fsm.receipt.Receipt resolved for this checkpoint
    refusal: str | None = None  # "<reason>: <message>" when that receipt refuses speculation


def head_key_files(path: Path, config: dict[str, Any], family: str) -> dict[str, list[str]]:
    """Map each safetensors file holding head tensors to those keys."""
    is_head = FAMILY_MODULES[family].is_head_key
    tcfg = text_config(config)
    found: dict[str, list[str]] = {}
    for f in sorted(path.glob("*.safetensors")):
        keys = [k for k in safetensors_keys(f) if k.startswith(MELIX_KEY_PREFIX) or is_head(k, tcfg)]
        if keys:
            found[f.name] = keys
    return found


def read_head_weights(
    path: Path, config: dict[str, Any], family: str, layers: list[int] | None
) -> tuple[dict[int, dict[str, mx.array]], str, tuple[str, ...]]:
    """Return ({layer: head parameter tensors}, format, source files) or raise MissingHeadWeights.

    ``layers`` None: every layer the checkpoint holds (raw HF: every advertised layer).
    """
    files = head_key_files(path, config, family)
    melix = config.get(MELIX_CONFIG_KEY)
    want_melix = isinstance(melix, dict) and melix.get("norms_repaired", False)
    fmt = "melix" if want_melix else "hf"
    selected: dict[str, list[str]] = {}
    for name, keys in files.items():
        keep = [k for k in keys if k.startswith(MELIX_KEY_PREFIX) == (fmt == "melix")]
        if keep:
            selected[name] = keep
    if not selected:
        where = f"{melix.get('file', SIDECAR_NAME)} (converted format)" if want_melix else "any"
        raise MissingHeadWeights(
            f"{path}: config advertises an MTP head but no head tensors were found in "
            f"{where} *.safetensors file (mlx-lm conversions drop them; convert from the "
            "original checkpoint with melix_mlx.loading.convert)",
            details={"path": str(path), "format": fmt},
        )
    raw: dict[str, mx.array] = {}
    for name, keys in selected.items():
        tensors = mx.load(str(path / name))
        raw.update({k: tensors[k] for k in keys})
    if fmt == "melix":
        return (
            _split_melix({k[len(MELIX_KEY_PREFIX) :]: v for k, v in raw.items()}, layers, path),
            fmt,
            tuple(selected),
        )
    # a block drafter's stages are one head (heads.deepseek_v41), not a layer per draft step
    one = getattr(FAMILY_MODULES[family], "STAGES_FORM_ONE_HEAD", False)
    count = 1 if one else max(advertised_head_count(config), 1)
    wanted = layers if layers is not None else list(range(count))
    out: dict[int, dict[str, mx.array]] = {}
    for j in wanted:
        out[j] = FAMILY_MODULES[family].from_hf(raw, text_config(config), layer=j)
        if not out[j]:
            raise MissingHeadWeights(
                f"{path}: no tensors for MTP layer {j}",
                details={"path": str(path), "layer": j},
            )
    return out, fmt, tuple(selected)


def _split_melix(
    weights: dict[str, mx.array], layers: list[int] | None, path: Path
) -> dict[int, dict[str, mx.array]]:
    """Converted tensors: ``heads.{j}.<param>`` for a multi-layer head, ``<param>`` for one layer."""
    if not any(k.startswith(STACKED_PREFIX) for k in weights):
        return {0: weights}
    out: dict[int, dict[str, mx.array]] = {}
    for key, value in weights.items():
        idx, _, rest = key[len(STACKED_PREFIX) :].partition(".")
        out.setdefault(int(idx), {})[rest] = value
    if layers is None:
        return dict(sorted(out.items()))
    missing = [j for j in layers if j not in out]
    if missing:
        raise MissingHeadWeights(
            f"{path}: converted head has no layer(s) {missing}", details={"missing": missing}
        )
    return {j: out[j] for j in layers}


def _stripping_classes(family: str, config: dict[str, Any]):
    """``get_model_classes`` for load_model that drops head keys before ``sanitize``."""
    is_head = FAMILY_MODULES[family].is_head_key
    tcfg = text_config(config)

    def get_classes(config: dict) -> tuple[Any, Any]:
        model_class, args_class = _get_classes(config)

        def build(args: Any) -> nn.Module:
            model = model_class(args)
            upstream = getattr(model, "sanitize", None)

            def sanitize(weights: dict) -> dict:
                weights = {k: v for k, v in weights.items() if not is_head(k, tcfg)}
                return upstream(weights) if upstream is not None else weights

            # an instance attribute shadows the class method for this load only
            model.sanitize = sanitize
            return model

        return build, args_class

    return get_classes


def load_main(path: str | Path, *, lazy: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """Load the main model via mlx-lm's ``load_model`` with head tensors filtered out."""
    path = Path(path)
    config = load_config(path)
    family = detect_family(config)
    model, config = load_model(path, lazy=lazy, get_model_classes=_stripping_classes(family, config))
    if "sanitize" in vars(model):
        del model.sanitize  # back to the class's own method
    return model, config


def _validate(head: nn.Module, weights: dict[str, mx.array], path: Path) -> None:
    expected = {k: v.shape for k, v in tree_flatten(head.parameters())}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise MissingHeadWeights(
            f"{path}: head tensors missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}",
            details={"missing": missing},
        )
    unexpected = sorted(set(weights) - set(expected))
    wrong = {
        k: (tuple(weights[k].shape), tuple(s))
        for k, s in expected.items()
        if tuple(weights[k].shape) != tuple(s)
    }
    if wrong or unexpected:
        raise HeadShapeMismatch(
            f"{path}: head tensors do not fit this model's config: "
            f"shapes (found, expected) {dict(list(wrong.items())[:8])}, "
            f"unexpected {unexpected[:8]}",
            details={"wrong_shapes": wrong, "unexpected": unexpected},
        )


def quantize_head_module(head: nn.Module, group_size: int, bits: int) -> None:
    """Quantize the head's Linear-like layers whose input dim the group size divides."""

    def predicate(_: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=predicate)


def build_layer(
    model: nn.Module, family: str, weights: dict[str, mx.array], own_lm_head: bool | None, path: Path
) -> tuple[MTPHeadBase, bool, bool]:
    """One head layer from its tensors: (head, uses its own lm_head, stored quantized)."""
    has_own = any(k.startswith("shared_head.head.") for k in weights)
    own = has_own if own_lm_head is None else (own_lm_head and has_own)
    if not own:
        weights = {k: v for k, v in weights.items() if not k.startswith("shared_head.head.")}
    head = HEAD_CLASSES[family].from_weights(model, weights, own_lm_head=own)
    stored_quantized = any(k.endswith(".scales") for k in weights)
    if stored_quantized:

        def predicate(p: str, m: nn.Module) -> Any:
            if f"{p}.scales" not in weights or not hasattr(m, "to_quantized"):
                return False
            return infer_quant_config(p, m, weights)

        nn.quantize(head, class_predicate=predicate)
    _validate(head, weights, path)
    head.load_weights(list(weights.items()), strict=True)
    return head, own, stored_quantized


def first_float_dtype(head: nn.Module) -> str:
    for _, v in tree_flatten(head.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "unknown"
