"""Load a main model through mlx-lm, then its MTP head from the same checkpoint.

Rules:
- The main model goes through ``mlx_lm.utils.load_model`` (the family's own ``sanitize``,
  strict weight load). Head tensors are removed from the weights handed to ``sanitize``
  first, because mlx-lm's deepseek_v3 only drops ``model.layers.61`` (hard-coded): any
  other depth with an in-file head would fail its strict load.
- Head tensors are read straight from every ``*.safetensors`` file in the directory,
  including a ``mtp.safetensors`` sidecar that mlx-lm's ``model*.safetensors`` glob skips.
- Two stored formats: raw HF names (family ``from_hf`` mapping: qwen3_5 (1+w) norms get
  +1, deepseek experts stacked / kv_b split / fp8 dequantised), or our converted format
  (``melix_mtp.<param>`` keys, config ``melix_mtp.norms_repaired: true``) loaded as is. So
  the +1 repair happens exactly once whichever directory is loaded.
- Every failure is a typed ``HeadLoadError`` raised before any decode, and before the main
  model is read when the head tensors are absent altogether.
- Quantization: a head stored unquantized stays unquantized even when the main model is
  quantized (quantizing the head costs acceptance); ``quantize_head=True`` quantizes it
  after loading. A head stored quantized (``convert(..., quantize_head=True)``) is
  rebuilt quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, infer_quant_config, load_config, load_model, load_tokenizer

from melix_fsm.checkpoint import safetensors_keys

from . import head_receipt
from .errors import HeadShapeMismatch, MissingHeadWeights, UnsupportedModel
from .families import advertised_head_count, detect_family, family_entry, text_config
from .heads import FAMILY_MODULES, HEAD_CLASSES, MTPHeadBase
from .heads.stacked import StackedHead

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


def _head_key_files(path: Path, config: dict[str, Any], family: str) -> dict[str, list[str]]:
    """Map each safetensors file holding head tensors to those keys."""
    is_head = FAMILY_MODULES[family].is_head_key
    tcfg = text_config(config)
    found: dict[str, list[str]] = {}
    for f in sorted(path.glob("*.safetensors")):
        keys = [k for k in safetensors_keys(f) if k.startswith(MELIX_KEY_PREFIX) or is_head(k, tcfg)]
        if keys:
            found[f.name] = keys
    return found


def _read_head_weights(
    path: Path, config: dict[str, Any], family: str, layers: list[int] | None
) -> tuple[dict[int, dict[str, mx.array]], str, tuple[str, ...]]:
    """Return ({layer: head parameter tensors}, format, source files) or raise MissingHeadWeights.

    ``layers`` None: every layer the checkpoint holds (raw HF: every advertised layer).
    """
    files = _head_key_files(path, config, family)
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
            "original checkpoint with melix_mlx.convert)",
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
    wanted = layers if layers is not None else list(range(max(advertised_head_count(config), 1)))
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


def _build_layer(
    model: nn.Module, family: str, weights: dict[str, mx.array], own_lm_head: bool | None, path: Path
) -> tuple[MTPHeadBase, bool, bool]:
    """One head layer from its tensors: (head, uses its own lm_head, stored quantized)."""
    has_own = any(k.startswith("shared_head.head.") for k in weights)
    own = has_own if own_lm_head is None else (own_lm_head and has_own)
    if not own:
        weights = {k: v for k, v in weights.items() if not k.startswith("shared_head.head.")}
    head = HEAD_CLASSES[family].from_model(model, own_lm_head=own)
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


def build_head(
    model: nn.Module,
    path: str | Path,
    config: dict[str, Any] | None = None,
    *,
    layer: int | None = None,
    own_lm_head: bool | None = None,
    lazy: bool = False,
) -> tuple[MTPHeadBase | StackedHead, dict[str, Any]]:
    """Build the head for an already loaded ``model`` from the checkpoint at ``path``.

    ``layer`` None loads every head layer the checkpoint ships (a ``StackedHead`` when
    there are several: draft step i runs layer i); an int loads that one layer alone.
    Returns ``(head, facts)``; ``facts`` feeds ``HeadInfo``. Raises ``HeadLoadError``s.
    """
    path = Path(path)
    config = load_config(path) if config is None else config
    family = detect_family(config)
    advertised = advertised_head_count(config)
    melix = config.get(MELIX_CONFIG_KEY) or {}
    if advertised <= 0 and not melix:
        raise UnsupportedModel(
            f"{path}: config advertises no MTP head ({family})",
            details={"family": family},
        )
    if layer is not None and layer >= max(advertised, 1):
        raise UnsupportedModel(f"{path}: MTP layer {layer} not advertised ({advertised})")
    per_layer, fmt, files = _read_head_weights(path, config, family, None if layer is None else [layer])
    built = [_build_layer(model, family, w, own_lm_head, path) for w in per_layer.values()]
    head: MTPHeadBase | StackedHead = built[0][0] if len(built) == 1 else StackedHead([b[0] for b in built])
    head.eval()
    if not lazy:
        mx.eval(head.parameters())
    facts = {
        "family": family,
        "model_type": str(config.get("model_type")),
        "advertised_layers": advertised,
        "layer_index": next(iter(per_layer)),
        "head_layers": len(built),
        "head_format": fmt,
        "source_files": files,
        "sidecar": any(not f.startswith("model") for f in files),
        "norms_repaired_on_load": family_entry(config).norm_repair == "plus_one" and fmt == "hf",
        "own_lm_head": built[0][1],
        "stored_quantized": built[0][2],
    }
    return head, facts


def _first_float_dtype(head: nn.Module) -> str:
    for _, v in tree_flatten(head.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "unknown"


def load_with_heads(
    path: str | Path,
    *,
    layer: int | None = None,
    quantize_head: bool = False,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    own_lm_head: bool | None = None,
    lazy: bool = False,
    tokenizer_config: dict[str, Any] | None = None,
    sidecar: str | Path | None = None,
) -> tuple[nn.Module, Any, MTPHeadBase | StackedHead, HeadInfo]:
    """Load ``(model, tokenizer, head, info)`` from a local checkpoint directory.

    ``quantize_head`` quantizes a float-stored head with ``q_bits``/``q_group_size``
    (default: the main model's quantization, else 4 bits / 64). ``own_lm_head``
    (deepseek_v3 only) chooses the head's own ``shared_head.head`` (default when stored)
    or the main lm_head. ``layer`` None loads every head layer (see ``build_head``).

    The checkpoint's receipt (``info.receipt``) is resolved first and attached to the
    head: where it refuses, the decoders decode plainly with its typed reason.

    ``sidecar``: an MTP pack directory for a target without head tensors; without it, a
    pack beside a head-less target is found by convention (melix_fsm.sidecar.find_pack).
    A pack is admitted only by its validation contract (melix_mlx.sidecar), else
    ``UnvalidatedSidecar`` names the failed check.
    """
    from melix_fsm.receipt import resolve
    from melix_fsm.sidecar import find_pack

    path = Path(path)
    config = load_config(path)
    family = detect_family(config)
    pack = Path(sidecar) if sidecar is not None else None
    if pack is None and not _head_key_files(path, config, family):
        pack = find_pack(path)
    if pack is not None:
        from .sidecar import load_with_sidecar

        return load_with_sidecar(path, pack, tokenizer_config=tokenizer_config)
    receipt = resolve(path)
    if advertised_head_count(config) <= 0 and not config.get(MELIX_CONFIG_KEY):
        raise UnsupportedModel(f"{path}: config advertises no MTP head ({family})")
    # fail fast on absent head tensors, before reading the main weights
    if not _head_key_files(path, config, family):
        raise MissingHeadWeights(
            f"{path}: config advertises an MTP head but no *.safetensors file holds it "
            "(mlx-lm conversions drop the head; convert from the original checkpoint "
            "with melix_mlx.convert)",
            details={"path": str(path)},
        )
    model, config = load_main(path, lazy=lazy)
    tokenizer = load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None))
    head, facts = build_head(model, path, config, layer=layer, own_lm_head=own_lm_head, lazy=lazy)
    main_quant = config.get("quantization") or {}
    if quantize_head and not facts["stored_quantized"]:
        quantize_head_module(
            head,
            group_size=q_group_size or main_quant.get("group_size", 64),
            bits=q_bits or main_quant.get("bits", 4),
        )
        if not lazy:
            mx.eval(head.parameters())
    head_receipt.attach(head, receipt)
    info = HeadInfo(
        family=facts["family"],
        model_type=facts["model_type"],
        advertised_layers=facts["advertised_layers"],
        layer_index=facts["layer_index"],
        head_layers=facts["head_layers"],
        head_format=facts["head_format"],
        source_files=facts["source_files"],
        sidecar=facts["sidecar"],
        norms_repaired_on_load=facts["norms_repaired_on_load"],
        head_dtype=_first_float_dtype(head),
        head_quantized=facts["stored_quantized"] or quantize_head,
        main_quantized=bool(main_quant),
        own_lm_head=facts["own_lm_head"],
        chain_post_norm=head.CHAIN_POST_NORM,
        concat_order=head.CONCAT_ORDER,
        num_params=sum(v.size for _, v in tree_flatten(head.parameters())),
        receipt=receipt,
        refusal=head_receipt.of_receipt(receipt),
    )
    return model, tokenizer, head, info
