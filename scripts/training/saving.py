"""Writing the checkpoint in the Hugging Face layout, and verifying it loads back.

DeepSeek-V3 keeps its head in ``mtp.safetensors`` under ``model.layers.{num_hidden_layers}.*``
and ``model.safetensors`` holds the main model only: mlx-lm 0.32's deepseek_v3 ``sanitize``
drops only the literal prefix ``model.layers.61``, so a head at any other index inside
``model*.safetensors`` makes the strict ``mlx_lm.load`` fail, and ``mtp.safetensors`` is
outside mlx-lm's ``model*.safetensors`` glob. ``model.safetensors.index.json`` maps every
tensor to its file, as Hugging Face sharded checkpoints do. Qwen3.5 keeps ``mtp.*`` inside
``model.safetensors``, as the released checkpoints do.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import deepseek_v3 as dsv3

from .data import EOS, tokenizer_config
from .deepseek_v3 import MTPHead, head_logits, head_to_hf, layer_from_hf, main_to_hf
from .qwen3_5 import qwen3_5_head_to_hf, qwen3_5_main_to_hf


def save_checkpoint(
    out: Path,
    main: Any,
    head: Any | None,
    config: dict[str, Any],
    tok: Any,
    dtype: mx.Dtype,
    family: str = "deepseek_v3",
) -> dict[str, str]:
    """Write the checkpoint. ``main`` is the whole mlx-lm model (for qwen3_5 the outer
    ``Model``). DeepSeek-V3 keeps its head in ``mtp.safetensors`` (see the module doc);
    Qwen3.5 keeps ``mtp.*`` inside ``model.safetensors`` as the released checkpoints do
    (mlx-lm's qwen3_5 ``sanitize`` drops every ``mtp.`` key)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}  # what HF writers put; transformers checks for it

    def cast(d: dict[str, mx.array]) -> dict[str, mx.array]:
        # The router's correction bias and A_log stay float32, as mlx-lm's cast_predicate
        # keeps them.
        return {
            k: (v if "e_score_correction_bias" in k or k.endswith("A_log") else v.astype(dtype))
            for k, v in sorted(d.items())
        }

    if family == "qwen3_5":
        main_w = cast(qwen3_5_main_to_hf(main))
        head_w = cast(qwen3_5_head_to_hf(head)) if head is not None else {}
        head_file = "model.safetensors"
        main_w = {**main_w, **head_w}
    else:
        main_w = cast(main_to_hf(main))
        head_w = cast(head_to_hf(head, main)) if head is not None else {}
        head_file = "mtp.safetensors"
    mx.save_safetensors(str(out / "model.safetensors"), main_w, metadata=meta)
    stale = out / "mtp.safetensors"
    if head_w and head_file == "mtp.safetensors":
        mx.save_safetensors(str(stale), head_w, metadata=meta)
    elif stale.exists():  # a draft model written over a checkpoint that had a head
        stale.unlink()
    weight_map = {k: "model.safetensors" for k in main_w}
    weight_map.update({k: head_file for k in head_w})
    size = sum(v.nbytes for v in main_w.values())
    if head_file != "model.safetensors":
        size += sum(v.nbytes for v in head_w.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    cfg = dict(config)
    cfg["torch_dtype"] = {mx.float32: "float32", mx.float16: "float16"}.get(dtype, "bfloat16")
    if "text_config" in cfg:
        cfg["text_config"] = {**cfg["text_config"], "dtype": cfg["torch_dtype"]}
    files = {
        "config.json": cfg,
        "model.safetensors.index.json": index,
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS},
        "generation_config.json": {"bos_token_id": cfg["bos_token_id"],
                                   "eos_token_id": cfg["eos_token_id"], "do_sample": False},
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    return {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest()
        for name in ("model.safetensors", "mtp.safetensors", "tokenizer.json")
        if (out / name).exists()
    }


def verify_checkpoint(
    out: Path, main: dsv3.Model, head: MTPHead | None, windows: np.ndarray
) -> dict[str, Any]:
    """mlx_lm.load the saved directory; compare main logits and (via our own inverse
    mapping) head logits with the in-memory models."""
    import mlx_lm

    loaded, tokenizer = mlx_lm.load(str(out))
    w = mx.array(windows[:4, :-1])
    ref = main(w)
    got = loaded(w).astype(mx.float32)
    main_diff = mx.abs(ref - got).max().item()
    same_argmax = (mx.argmax(ref, -1) == mx.argmax(got, -1)).mean().item()
    prompt = "import os\n\n\ndef "
    text = mlx_lm.generate(loaded, tokenizer, prompt, max_tokens=48, verbose=False)
    result: dict[str, Any] = {
        "mlx_lm_load": "ok",
        "main_logits_max_abs_diff": main_diff,
        "main_argmax_agreement": same_argmax,
    }
    if head is None:
        result["greedy_sample"] = {"prompt": prompt, "completion": text}
        return result
    if not hasattr(head, "eh_proj"):  # Qwen3.5: the project's loader reads the head back
        from melix_mlx.loading import load_with_heads

        model2, _, head2, info = load_with_heads(out)
        h = main.model(w)
        a = head(h[:, :-1], w[:, 1:])[0]
        b = head2(model2.language_model.model(w)[:, :-1], w[:, 1:])[0].astype(mx.float32)
        return {
            **result,
            "head_logits_max_abs_diff": mx.abs(a - b).max().item(),
            "head_argmax_agreement": (mx.argmax(a, -1) == mx.argmax(b, -1)).mean().item(),
            "load_with_heads": {"family": getattr(info, "family", None),
                                "norms_repaired_on_load": getattr(info, "norms_repaired_on_load",
                                                                  None)},
            "greedy_sample": {"prompt": prompt, "completion": text},
        }

    args = main.args
    weights = mx.load(str(out / "mtp.safetensors"))
    fresh = MTPHead(args)
    prefix = f"model.layers.{args.num_hidden_layers}"
    fresh.load_weights(
        [(k, v.astype(mx.float32)) for k, v in layer_from_hf(weights, prefix, args).items()
         if not k.startswith(("embed_tokens.", "shared_head.head."))],
        strict=True,
    )
    h = main.model(w)
    e = main.model.embed_tokens(w[:, 1:])
    a = head_logits(head, main, head.hidden(h[:, :-1], e))
    b = head_logits(fresh, main, fresh.hidden(h[:, :-1], e))
    head_diff = mx.abs(a - b).max().item()
    return {
        **result,
        "head_logits_max_abs_diff": head_diff,
        "head_tensors_shared_equal": bool(
            mx.array_equal(weights[f"{prefix}.shared_head.head.weight"],
                           loaded.lm_head.weight).item()
            and mx.array_equal(weights[f"{prefix}.embed_tokens.weight"],
                               loaded.model.embed_tokens.weight).item()
        ),
        "greedy_sample": {"prompt": prompt, "completion": text},
    }
