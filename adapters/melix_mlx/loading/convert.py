"""Convert an HF checkpoint to an mlx checkpoint that KEEPS the MTP head.

Rules:
- The main model follows ``mlx_lm.convert``'s steps with mlx-lm's own functions (load,
  dtype cast honouring ``cast_predicate``, ``quantize_model``, ``save``); the only change
  is that the head is read by ``loading.build_head`` instead of being dropped.
- The head is written to ``mtp.safetensors`` as ``melix_mtp.<head parameter name>``,
  already repaired (qwen3_5 norms +1, deepseek experts stacked and kv_b split), and
  ``config.json`` records ``melix_mtp`` = {format_version, family, file, norms_repaired:
  true, head_dtype, quantized, quantization, layer_index, head_layers, own_lm_head}.
  Loading reads that record and never repairs again.
- Every head layer the checkpoint ships is kept (a multi-layer head is written as
  ``melix_mtp.heads.{j}.<param>``); ``layer=j`` keeps layer j alone.
- The head stays unquantized when the main model is quantized unless
  ``quantize_head=True`` (quantizing it costs acceptance). Quantization only touches
  layers whose input dim ``q_group_size`` divides (tiny models: use 32 or 64).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import load_config, load_tokenizer, quantize_model, save, save_config

from .loaders import (
    MELIX_CONFIG_KEY,
    MELIX_FORMAT_VERSION,
    MELIX_KEY_PREFIX,
    SIDECAR_NAME,
    build_head,
    load_main,
    quantize_head_module,
)

_DTYPES = ("float16", "bfloat16", "float32")


def _resolve_dtype(config: dict[str, Any], dtype: str | None) -> str | None:
    if dtype is None:
        dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    return dtype if dtype in _DTYPES else None


def convert(
    hf_dir: str | Path,
    out_dir: str | Path,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    *,
    dtype: str | None = None,
    quantize_head: bool = False,
    layer: int | None = None,
) -> Path:
    """Convert ``hf_dir`` into ``out_dir`` (must not exist or be empty); return ``out_dir``."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")

    config = load_config(hf_dir)
    model, config = load_main(hf_dir, lazy=True)
    head, facts = build_head(model, hf_dir, config, layer=layer, lazy=True)
    tokenizer = load_tokenizer(hf_dir, eos_token_ids=config.get("eos_token_id", None))

    target = _resolve_dtype(config, dtype)
    if target is not None:
        cast = getattr(model, "cast_predicate", lambda _: True)
        mx_dtype = getattr(mx, target)

        def set_dtype(k: str, v: mx.array) -> mx.array:
            return v.astype(mx_dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v

        model.update(tree_map_with_path(set_dtype, model.parameters()))
        # DeepSeek's router correction bias stays float32 like the main model's
        head.update(tree_map_with_path(set_dtype, head.parameters()))

    if quantize:
        model, config = quantize_model(model, config, q_group_size, q_bits)
    if quantize_head:
        quantize_head_module(head, group_size=q_group_size, bits=q_bits)

    head_params = dict(tree_flatten(head.parameters()))
    mx.eval(head_params)  # materialise before the main model's weights are donated
    save(out_dir, hf_dir, model, tokenizer, config)
    mx.save_safetensors(
        str(out_dir / SIDECAR_NAME),
        {MELIX_KEY_PREFIX + k: v for k, v in head_params.items()},
        metadata={"format": "mlx"},
    )
    first_float = next(
        (str(v.dtype) for v in head_params.values() if mx.issubdtype(v.dtype, mx.floating)),
        "unknown",
    ).removeprefix("mlx.core.")
    saved = load_config(out_dir)
    saved[MELIX_CONFIG_KEY] = {
        "format_version": MELIX_FORMAT_VERSION,
        "family": facts["family"],
        "file": SIDECAR_NAME,
        "norms_repaired": True,
        "head_dtype": first_float,
        "quantized": quantize_head,
        "quantization": ({"group_size": q_group_size, "bits": q_bits} if quantize_head else None),
        "layer_index": facts["layer_index"],
        "head_layers": facts["head_layers"],
        "own_lm_head": facts["own_lm_head"],
        "source_format": facts["head_format"],
    }
    save_config(saved, out_dir / "config.json")
    return out_dir
