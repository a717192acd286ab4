"""Starting from an earlier checkpoint: continuing its main model (``--init-from``), depth
growth (``--grow-from``) and reading back its head (``--init-head``).

Growth copies a shallower model's layers, block by block (one full-attention period), in
order into evenly spread blocks of the deeper one and zeroes the new layers' residual-branch
output projections, so the grown model computes the old function exactly before training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .deepseek_v3 import layer_from_hf
from .models import Models

# Each layer's residual-branch outputs: zeroed, a layer adds nothing to its input.
_BRANCH_OUTPUTS = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow_layers(new: list[nn.Module], old: list[nn.Module], interval: int) -> list[int]:
    """Depth growth: the ``old`` layers, block by block (``interval`` layers, the hybrid's
    period), are copied into evenly spread blocks of ``new``, in order; every other new layer
    has its residual-branch output projections zeroed, so the grown model computes exactly
    the old model's function before training. Returns the new index of each old layer."""
    if len(old) % interval or len(new) % interval or len(new) < len(old):
        raise SystemExit(f"--grow-from: {len(old)} -> {len(new)} layers is not whole blocks "
                         f"of {interval}")
    old_blocks, new_blocks = len(old) // interval, len(new) // interval
    placed = {b * new_blocks // old_blocks: b for b in range(old_blocks)}
    where: list[int] = []
    for nb in range(new_blocks):
        for j in range(interval):
            layer = new[nb * interval + j]
            if nb in placed:
                layer.update(old[placed[nb] * interval + j].parameters())
                where.append(nb * interval + j)
                continue
            flat = dict(tree_flatten(layer.parameters()))
            layer.load_weights([(k, mx.zeros_like(flat[k])) for k in _BRANCH_OUTPUTS if k in flat],
                               strict=False)
    return where


def stored_head(path: Path, family: str, args: Any) -> dict[str, mx.array]:
    """The head's own tensors of checkpoint ``path`` under the training head's names."""
    if family == "qwen3_5":
        from melix_mlx.loading.heads.qwen3_5 import from_hf

        raw = mx.load(str(path / "model.safetensors"))
        return {k: v.astype(mx.float32) for k, v in from_hf(raw, {}).items()}
    prefix = f"model.layers.{args.num_hidden_layers}"
    weights = mx.load(str(path / "mtp.safetensors"))
    return {k: v.astype(mx.float32) for k, v in layer_from_hf(weights, prefix, args).items()
            if not k.startswith(("embed_tokens.", "shared_head.head."))}


def continue_main(models: Models, path: Path, log: Callable[[str], None]) -> None:
    """``--init-from``: the main model takes ``path``'s weights (same class and shape)."""
    import mlx_lm

    prev = json.loads((path / "config.json").read_text())
    prev, cur = prev.get("text_config", prev), models.config.get("text_config", models.config)
    shape = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size")
    if any(prev.get(k) != cur.get(k) for k in shape):
        raise SystemExit(f"--init-from {path}: a different model shape")
    previous, _ = mlx_lm.load(str(path))
    models.whole.update(previous.parameters())  # same class and config: the same tree
    mx.eval(models.whole.parameters())
    log(f"main model initialised from {path}")


def grow_main(models: Models, path: Path, interval: int, log: Callable[[str], None]) -> list[int]:
    """``--grow-from``: the deeper main model starts as ``path``'s shallower one (same widths);
    returns where the old layers went."""
    import mlx_lm

    prev = json.loads((path / "config.json").read_text())["text_config"]
    same = ("hidden_size", "intermediate_size", "num_attention_heads", "full_attention_interval")
    if any(prev.get(k) != models.config["text_config"].get(k) for k in same):
        raise SystemExit(f"--grow-from {path}: different widths or period")
    previous, _ = mlx_lm.load(str(path))
    old_text, main_model = previous.language_model, models.main
    grown_at = grow_layers(main_model.model.layers, old_text.model.layers, interval)
    main_model.model.embed_tokens.update(old_text.model.embed_tokens.parameters())
    main_model.model.norm.update(old_text.model.norm.parameters())
    main_model.lm_head.update(old_text.lm_head.parameters())
    mx.eval(models.whole.parameters())
    log(f"main model grown from {path}: its layers at {grown_at}")
    return grown_at


def init_head(models: Models, path: Path, family: str, log: Callable[[str], None]) -> None:
    """``--init-head``: the head starts from ``path``'s stored head."""
    models.head.load_weights(list(stored_head(path, family, models.args).items()), strict=True)
    mx.eval(models.head.parameters())
    log(f"head initialised from {path}")
