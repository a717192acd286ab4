"""Load a main model through mlx-lm, then its MTP head from the same checkpoint (or a
validated sidecar pack). This is the import path users embed (`load_with_heads`).

Rules:
- The main model goes through ``mlx_lm.utils.load_model`` (the family's own ``sanitize``,
  strict weight load). Head tensors are removed from the weights handed to ``sanitize``
  first, because mlx-lm's deepseek_v3 only drops ``model.layers.61`` (hard-coded): any
  other depth with an in-file head would fail its strict load.
- Reading, checking and building head layers from their tensors is
  melix_mlx.loading.head_weights' (both stored formats; the +1 norm repair happens exactly once
  whichever directory is loaded); this module assembles whole heads and the receipt.
- Every failure is a typed ``HeadLoadError`` raised before any decode, and before the main
  model is read when the head tensors are absent altogether.
- ``load_with_heads`` returns a ``Loaded`` named tuple ``(model, tokenizer, head, info)``
  (unpacking as four names keeps working) with ``.receipt``: the checkpoint's typed
  receipt (melix_fsm.receipt.Receipt), resolved for the ``num_draft_tokens`` /
  ``device_policy`` it was given. Those settings are checked before anything is read
  (``SettingError``) and become the decoders' defaults for this head.
- Quantization: a head stored unquantized stays unquantized even when the main model is
  quantized (quantizing the head costs acceptance); ``quantize_head=True`` quantizes it
  after loading. A head stored quantized (``convert(..., quantize_head=True)``) is
  rebuilt quantized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_config, load_tokenizer

from melix_fsm.checkpoint import safetensors_keys

from . import head_receipt
from .checkpoints import resolve_model
from .errors import MissingHeadWeights, UnsupportedModel
from .families import advertised_head_count, detect_family, family_entry
from .head_weights import (
    MELIX_CONFIG_KEY,
    MELIX_FORMAT_VERSION,
    MELIX_KEY_PREFIX,
    SIDECAR_NAME,
    STACKED_PREFIX,
    HeadInfo,
    build_layer,
    first_float_dtype,
    head_key_files,
    load_main,
    quantize_head_module,
    read_head_weights,
)
from .heads import MTPHeadBase
from .heads.stacked import StackedHead
from .sidecar import load_with_sidecar

# Names users and the converter import from here (this is the public loading path).
__all__ = [
    "MELIX_CONFIG_KEY",
    "MELIX_FORMAT_VERSION",
    "MELIX_KEY_PREFIX",
    "SIDECAR_NAME",
    "STACKED_PREFIX",
    "HeadInfo",
    "Loaded",
    "build_head",
    "load_main",
    "load_with_heads",
    "quantize_head_module",
    "safetensors_keys",
]


class Loaded(NamedTuple):
    """What ``load_with_heads`` returns: unpack it as four names, or read ``.receipt``."""

    model: nn.Module
    tokenizer: Any
    head: MTPHeadBase | StackedHead
    info: HeadInfo

    @property
    def receipt(self) -> Any:
        """The checkpoint's receipt (melix_fsm.receipt.Receipt), before the device policy."""
        return self.info.receipt


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
    per_layer, fmt, files = read_head_weights(path, config, family, None if layer is None else [layer])
    built = [build_layer(model, family, w, own_lm_head, path) for w in per_layer.values()]
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
    num_draft_tokens: int | Literal["auto"] | None = None,
    device_policy: Literal["auto", "force_on", "force_off"] | None = None,
) -> Loaded:
    """Load ``(model, tokenizer, head, info)`` from a local checkpoint directory, or an
    embedded checkpoint by name (``stdlib-tiny``, ``stdlib-hybrid``: melix_mlx.loading.checkpoints;
    an existing directory of that name wins).

    ``quantize_head`` quantizes a float-stored head with ``q_bits``/``q_group_size``
    (default: the main model's quantization, else 4 bits / 64). ``own_lm_head``
    (deepseek_v3 only) chooses the head's own ``shared_head.head`` (default when stored)
    or the main lm_head. ``layer`` None loads every head layer (see ``build_head``).

    The checkpoint's receipt (``info.receipt``) is resolved first and attached to the
    head: where it refuses, the decoders decode plainly with its typed reason.

    ``sidecar``: an MTP pack directory for a target without head tensors; without it, a
    pack beside a head-less target is found by convention (melix_fsm.sidecar.find_pack).
    A pack is admitted only by its validation contract (melix_mlx.loading.sidecar), else
    ``UnvalidatedSidecar`` names the failed check.

    ``num_draft_tokens`` (an int or ``"auto"``) / ``device_policy`` (``"auto"``,
    ``"force_on"``, ``"force_off"``): the receipt is resolved for them, and the decoders
    use them for this head when their own are left out (None: not given).
    """
    from melix_fsm.config import check_settings, speculative_config
    from melix_fsm.receipt import resolve
    from melix_fsm.sidecar import find_pack

    check_settings(num_draft_tokens, device_policy)
    given = {"num_draft_tokens": num_draft_tokens, "device_policy": device_policy}
    settings = {name: value for name, value in given.items() if value is not None}
    path = resolve_model(path)
    config = load_config(path)
    family = detect_family(config)
    pack = Path(sidecar) if sidecar is not None else None
    if pack is None and not head_key_files(path, config, family):
        pack = find_pack(path)
    if pack is not None:
        loaded = Loaded(*load_with_sidecar(path, pack, tokenizer_config=tokenizer_config))
        head_receipt.attach_settings(loaded.head, settings)
        return loaded
    # the head carries the checkpoint's own receipt (the decoders' fail-closed check); the
    # settings given here are applied per call, so a later call may override them
    checkpoint_receipt = resolve(path)
    receipt = resolve(path, speculative_config(**settings)) if settings else checkpoint_receipt
    _check_head_present(path, config, family)
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
    head_receipt.attach(head, checkpoint_receipt)
    head_receipt.attach_settings(head, settings)
    info = _head_info(
        head, facts, receipt, quantized=facts["stored_quantized"] or quantize_head, main_quant=main_quant
    )
    return Loaded(model, tokenizer, head, info)


def _check_head_present(path: Path, config: dict[str, Any], family: str) -> None:
    """Fail fast, before reading the main weights, on a config without a head or a
    checkpoint whose files lack the head it advertises."""
    if advertised_head_count(config) <= 0 and not config.get(MELIX_CONFIG_KEY):
        raise UnsupportedModel(f"{path}: config advertises no MTP head ({family})")
    if not head_key_files(path, config, family):
        raise MissingHeadWeights(
            f"{path}: config advertises an MTP head but no *.safetensors file holds it "
            "(mlx-lm conversions drop the head; convert from the original checkpoint "
            "with melix_mlx.loading.convert)",
            details={"path": str(path)},
        )


def _head_info(
    head: MTPHeadBase | StackedHead, facts: dict[str, Any], receipt: Any, *, quantized: bool, main_quant: dict
) -> HeadInfo:
    """What a loaded head is, for the receipt and the reports."""
    return HeadInfo(
        family=facts["family"],
        model_type=facts["model_type"],
        advertised_layers=facts["advertised_layers"],
        layer_index=facts["layer_index"],
        head_layers=facts["head_layers"],
        head_format=facts["head_format"],
        source_files=facts["source_files"],
        sidecar=facts["sidecar"],
        norms_repaired_on_load=facts["norms_repaired_on_load"],
        head_dtype=first_float_dtype(head),
        head_quantized=quantized,
        main_quantized=bool(main_quant),
        own_lm_head=facts["own_lm_head"],
        chain_post_norm=head.CHAIN_POST_NORM,
        concat_order=head.CONCAT_ORDER,
        num_params=sum(v.size for _, v in tree_flatten(head.parameters())),
        receipt=receipt,
        refusal=head_receipt.of_receipt(receipt),
    )
