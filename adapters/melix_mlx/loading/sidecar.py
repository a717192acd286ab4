"""Run the sidecar-pack contract (melix_fsm.sidecar) against a loaded target model.

Rules:
- ``validate_pack(target_dir, pack_dir, model, tokenizer)`` runs the checks in contract
  order and stops at the first failure (later checks are reported ``not_run``). It
  returns the report and, when keys, shapes, dtypes and quantization passed, the head
  built from the pack (with every head layer the pack ships).
- The head tensors are read and mapped exactly as an in-checkpoint head (the family's
  ``from_hf``, or the converted ``melix_mtp.*`` format when the pack's config records
  it), so a pack is held to the same layout rules as a full checkpoint.
- ``load_with_sidecar`` is ``load_with_heads`` for a target plus a pack: the receipt is
  resolved with the report, and a pack that fails is a typed ``UnvalidatedSidecar`` (its
  report and the refused receipt attached). Nothing is admitted without the probe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_config, load_tokenizer

from melix_fsm.checkpoint import config_value, safetensors_header
from melix_fsm.registry import registry
from melix_fsm.sidecar import PROBE_ALPHA, SidecarReport, chance_p_value, report

from ..runtime.hidden import forward_with_hidden, main_parts
from .errors import HeadShapeMismatch, MissingHeadWeights, UnsupportedModel
from .families import advertised_head_count, detect_family, family_entry, text_config
from .head_pack import is_split_pack, split_layers
from .head_weights import (
    MELIX_CONFIG_KEY,
    MELIX_KEY_PREFIX,
    HeadInfo,
    build_layer,
    first_float_dtype,
    load_main,
    read_head_weights,
)
from .heads import FAMILY_MODULES

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens"
PROBE_TOKENS = 32  # the target's own greedy continuation the head is scored on
FLOAT_DTYPES = {"F16", "BF16", "F32"}


def _config_check(target_cfg: dict, pack: Path) -> tuple[bool, str, dict, int]:
    """(passed, detail, the pack's config or {}, head layers) for the ``config`` check."""
    entry = family_entry(target_cfg)
    target_text = text_config(target_cfg)
    advertised = advertised_head_count(target_cfg)
    file = pack / "config.json"
    if not file.is_file():
        if advertised < 1:
            return False, "the pack has no config.json and the target advertises no head layer", {}, 0
        return (
            True,
            f"no config.json in the pack: the target's ({entry.name}, {advertised} layer(s))",
            {},
            advertised,
        )
    try:
        pack_cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return False, f"config.json unreadable: {exc}", {}, 0
    text = pack_cfg.get("text_config", pack_cfg) if isinstance(pack_cfg, dict) else {}
    # a split-drafter pack carries its source's text_config: that names the family (the
    # root model_type is the drafter's, e.g. qwen3_5_mtp for a qwen3_5_moe source too)
    model_type = str(text.get("model_type") or pack_cfg.get("model_type") or "")
    for suffix in registry().sidecar.model_type_suffixes:
        model_type = model_type.removesuffix(suffix)
    family = registry().family_for(model_type) if model_type else entry
    if family is None or family.name != entry.name:
        return False, f"pack model_type {model_type!r} is not the target's family {entry.name}", pack_cfg, 0
    for key in ("hidden_size", "vocab_size"):
        if key in text and text[key] != target_text.get(key):
            return False, f"{key} {text[key]} != the target's {target_text.get(key)}", pack_cfg, 0
    layers = next(
        (int(v) for k in entry.head_count_keys for found, v in [config_value(pack_cfg, k)] if found and v),
        advertised,
    )
    if layers < 1 or (advertised >= 1 and layers != advertised):
        return (
            False,
            f"pack holds {layers} head layer(s), the target's config advertises {advertised}",
            pack_cfg,
            0,
        )
    return True, f"{entry.name}, hidden {target_text.get('hidden_size')}, {layers} layer(s)", pack_cfg, layers


def _headers(pack: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in sorted(pack.glob("*.safetensors")):
        out.update(safetensors_header(f))
    return out


def _dtype_check(headers: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[bool, str]:
    for key, (dtype, _) in sorted(headers.items()):
        if dtype in FLOAT_DTYPES:
            continue
        if dtype == "U32" and key.endswith(".weight") and f"{key[: -len('.weight')]}.scales" in headers:
            continue  # packed quantized weight
        if dtype == "F8_E4M3" and f"{key}_scale_inv" in headers:
            continue  # DeepSeek block fp8 with its inverse scales
        return False, f"{key}: dtype {dtype} is not a head tensor dtype"
    return True, f"{len(headers)} tensors, dtypes {sorted({d for d, _ in headers.values()})}"


def _quant_structure(headers: dict, pack_cfg: dict, target_cfg: dict) -> tuple[bool, str, dict | None]:
    scales = [k[: -len(".scales")] for k in headers if k.endswith(".scales")]
    if not scales:
        return True, "float head (not quantized)", None
    for base in scales:
        if f"{base}.weight" not in headers:
            return False, f"{base}: scales without a packed weight", None
        if headers[f"{base}.scales"][0] != "U8" and f"{base}.biases" not in headers:
            return False, f"{base}: affine scales without biases", None
    declared = pack_cfg.get("quantization") or target_cfg.get("quantization")
    if not isinstance(declared, dict):
        return False, "quantized tensors, but neither the pack nor the target declares a quantization", None
    return True, "", declared


def _quant_match(head: nn.Module, declared: dict) -> tuple[bool, str]:
    found = {(m.bits, m.group_size) for _, m in head.named_modules() if isinstance(m, nn.QuantizedLinear)}
    want = (declared.get("bits"), declared.get("group_size"))
    if found and found != {want}:
        return False, f"tensors are packed as (bits, group) {sorted(found)}, the config declares {want}"
    return True, f"{len(found) and want[0]}-bit, group {want[1]}"


def _probe(model: nn.Module, tokenizer: Any, head: nn.Module, vocab: int) -> tuple[bool, str]:
    prompt = list(tokenizer.encode(PROBE_TEXT))
    cont = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=PROBE_TOKENS)]
    seq = mx.array([prompt + cont])
    _, hidden = forward_with_hidden(model, seq, make_prompt_cache(model))
    logits, _ = head(hidden[:, :-1], seq[:, 1:], head.make_cache())  # slot i predicts token i + 2
    if not mx.isfinite(logits).all().item():
        return False, "the head's logits are not finite"
    first = max(len(prompt) - 2, 0)  # score only tokens the target chose itself
    preds = mx.argmax(logits[0, first:-1], axis=-1)
    wanted = seq[0, first + 2 :]
    hits, trials = int((preds == wanted).sum().item()), int(wanted.size)
    p = chance_p_value(hits, trials, 1.0 / vocab)
    detail = f"{hits}/{trials} next-next tokens agree with the target (chance 1/{vocab}, p = {p:.2g})"
    return p < PROBE_ALPHA, detail


def _layers(pack: Path, read_cfg: dict, family: str, layers: int, split: bool) -> dict[int, dict]:
    """Each head layer's tensors: the split-drafter layout as stored, else the family's mapping."""
    if not split:
        return read_head_weights(pack, read_cfg, family, list(range(layers)))[0]
    tensors: dict[str, mx.array] = {}
    for f in sorted(pack.glob("*.safetensors")):
        tensors.update(mx.load(str(f)))
    return split_layers(tensors, family, layers, pack)


def validate_pack(
    target: str | Path, pack: str | Path, model: nn.Module, tokenizer: Any, target_cfg: dict | None = None
) -> tuple[SidecarReport, nn.Module | None]:
    """Run the contract for ``pack`` offered to ``target`` (already loaded as ``model``)."""
    from .heads.stacked import StackedHead

    target, pack = Path(target), Path(pack)
    target_cfg = load_config(target) if target_cfg is None else target_cfg
    results: dict[str, tuple[bool, str]] = {}
    family = detect_family(target_cfg)
    ok, detail, pack_cfg, layers = _config_check(target_cfg, pack)
    results["config"] = (ok, detail)
    headers = _headers(pack) if ok else {}
    files = sorted(f.name for f in pack.glob("*.safetensors"))
    is_head = FAMILY_MODULES[family].is_head_key
    tcfg = text_config(target_cfg)
    split = is_split_pack(pack_cfg, list(headers), family, target_cfg)
    head_keys = [k for k in headers if split or k.startswith(MELIX_KEY_PREFIX) or is_head(k, tcfg)]
    done = lambda: (report(pack, results, files, len(head_keys)), None)  # noqa: E731
    if not ok:
        return done()
    others = sorted(set(headers) - set(head_keys))
    if not head_keys or others:
        why = "no head tensors" if not head_keys else f"non-head tensors {others[:4]} (a model, not a pack)"
        results["keys"] = (False, why)
        return done()
    read_cfg = {
        **target_cfg,
        **({MELIX_CONFIG_KEY: pack_cfg[MELIX_CONFIG_KEY]} if MELIX_CONFIG_KEY in pack_cfg else {}),
    }
    ok, detail = _dtype_check({k: headers[k] for k in head_keys})
    dtypes = (ok, detail)
    qok, qdetail, declared = _quant_structure(headers, pack_cfg, target_cfg)
    try:
        per_layer = _layers(pack, read_cfg, family, layers, split)
        built = [build_layer(model, family, w, None, pack)[0] for w in per_layer.values()]
    except (MissingHeadWeights, UnsupportedModel) as exc:
        results["keys"] = (False, str(exc))
        return done()
    except HeadShapeMismatch as exc:
        if exc.details.get("unexpected"):
            results["keys"] = (False, f"unexpected tensors {exc.details['unexpected'][:4]}")
        else:
            results["keys"] = (True, f"{len(head_keys)} head tensors")
            results["shapes"] = (
                False,
                f"(found, expected) {dict(list(exc.details['wrong_shapes'].items())[:4])}",
            )
        return done()
    results["keys"] = (True, f"{len(head_keys)} head tensors for {layers} layer(s)")
    results["shapes"] = (True, "every tensor fits the target's config")
    results["dtypes"] = dtypes
    if not dtypes[0]:
        return done()
    head = built[0] if len(built) == 1 else StackedHead(built)
    head.eval()
    if qok and declared is not None:
        qok, qdetail = _quant_match(head, declared)
    results["quantization"] = (qok, qdetail)
    if not qok:
        return done()
    mx.eval(head.parameters())
    results["probe"] = _probe(model, tokenizer, head, int(main_parts(model).args.vocab_size))
    return report(pack, results, files, len(head_keys)), head


def load_with_sidecar(
    path: str | Path,
    pack: str | Path,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    speculative: Any = None,
    context: Any = None,
    machine: Any = None,
) -> tuple[nn.Module, Any, nn.Module, Any]:
    """``(model, tokenizer, head, info)`` for ``path`` with its head from ``pack``.

    ``speculative`` / ``context`` / ``machine`` go to ``melix_fsm.receipt.resolve`` (the CLI's
    speculative config, serving context and the row's lifecycle machine). Raises
    ``UnvalidatedSidecar`` (report and refused receipt attached) when the pack fails
    any check of the contract.
    """
    from melix_fsm.receipt import resolve

    from . import head_receipt
    from .errors import UnvalidatedSidecar

    path, pack = Path(path), Path(pack)
    model, config = load_main(path)
    tokenizer = load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None))
    result, head = validate_pack(path, pack, model, tokenizer, config)
    receipt = resolve(path, speculative, context=context, machine=machine, sidecar=result)
    if head is None or not result.validated:
        raise UnvalidatedSidecar(f"{pack}: {result.failure}", report=result, receipt=receipt)
    head_receipt.attach(head, receipt)
    main_quant = config.get("quantization") or {}
    pack_cfg = json.loads((pack / "config.json").read_text()) if (pack / "config.json").is_file() else {}
    fmt = "melix" if isinstance(pack_cfg.get(MELIX_CONFIG_KEY), dict) else "hf"
    if is_split_pack(pack_cfg, list(_headers(pack)), detect_family(config), config):
        fmt = "split"  # stored in MLX form: norms were repaired when the pack was written
    info = HeadInfo(
        family=detect_family(config),
        model_type=str(config.get("model_type")),
        advertised_layers=advertised_head_count(config),
        layer_index=0,
        head_layers=len(getattr(head, "heads", [head])),
        head_format=fmt,
        source_files=tuple(result.files),
        sidecar=True,
        norms_repaired_on_load=family_entry(config).norm_repair == "plus_one" and fmt == "hf",
        head_dtype=first_float_dtype(head),
        head_quantized=any(isinstance(m, nn.QuantizedLinear) for _, m in head.named_modules()),
        main_quantized=bool(main_quant),
        own_lm_head=False,
        chain_post_norm=head.CHAIN_POST_NORM,
        concat_order=head.CONCAT_ORDER,
        num_params=sum(v.size for _, v in tree_flatten(head.parameters())),
        receipt=receipt,
        refusal=head_receipt.of_receipt(receipt),
    )
    return model, tokenizer, head, info
