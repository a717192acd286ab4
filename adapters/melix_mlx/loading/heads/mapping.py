"""Raw checkpoint tensors -> head parameter names: the steps several families' ``from_hf`` share.

Rules:
- A family's ``from_hf`` composes these with its own names (prefixes, renames, the
  parameter names its head keeps at the top); what is the same for several families
  lives here once.
- A step that cannot apply (an expert missing, a ``kv_b_proj`` of another shape) leaves
  the tensors as they are, so the loader's shape check names them precisely.
- The rotary tables some checkpoints store (``rotary_emb.inv_freq``) are never loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

ROPE_TABLE = "rotary_emb.inv_freq"
SWIGLU = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj"))
_FP8_BLOCK = 128


def is_appended_layer_key(key: str, config: dict[str, Any]) -> bool:
    """``model.layers.{i}.*`` with i >= ``num_hidden_layers``: the heads stored as extra layers."""
    if not key.startswith("model.layers."):
        return False
    idx = key.split(".", 3)[2]
    return idx.isdigit() and int(idx) >= int(config["num_hidden_layers"])


def appended_layer_prefix(config: dict[str, Any], layer: int) -> str:
    return f"model.layers.{int(config['num_hidden_layers']) + layer}."


def renamed(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first matching leading ``old`` of ``pairs`` replaced by its ``new``."""
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def layer_tensors(
    raw: dict[str, mx.array],
    prefix: str,
    own: tuple[str, ...],
    *,
    drop: tuple[str, ...] = (ROPE_TABLE,),
    rename: Callable[[str], str] | None = None,
) -> dict[str, mx.array]:
    """The tensors under ``prefix`` by head name: names containing a ``drop`` part are
    skipped, ``rename`` applied, the head's ``own`` names kept and the rest (the decoder
    layer's) put under ``block.``."""
    out: dict[str, mx.array] = {}
    for key, value in raw.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if any(d in name for d in drop):
            continue
        if rename is not None:
            name = rename(name)
        out[name if name.startswith(own) else f"block.{name}"] = value
    return out


def module_layer_tensors(
    raw: dict[str, mx.array], prefixes: tuple[str, ...], layer: int, *, drop: tuple[str, ...] = ()
) -> dict[str, mx.array]:
    """The tensors under the first matching ``prefixes`` of a head module whose layers sit at
    ``layers.{j}`` beside pieces they share (``fc``, norms): layer ``layer``'s as
    ``layers.0.*``, the other layers' skipped, the shared pieces as they are."""
    out: dict[str, mx.array] = {}
    for key, value in raw.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None or any(d in key for d in drop):
            continue
        name = key[len(prefix) :]
        if name.startswith("layers."):
            idx, _, rest = name[len("layers.") :].partition(".")
            if int(idx) != layer:
                continue  # one MTP layer per head module
            name = f"layers.0.{rest}"
        out[name] = value
    return out


def dequant_fp8(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """Undo DeepSeek-style fp8 storage: e4m3 weight times a per-128x128-block inverse scale."""
    out = {k: v for k, v in w.items() if not k.endswith("_scale_inv")}
    for key, scale_inv in w.items():
        if not key.endswith(".weight_scale_inv"):
            continue
        wk = key[: -len("_scale_inv")]
        weight = mx.from_fp8(w[wk], dtype=mx.bfloat16)
        rows, cols = weight.shape
        b = _FP8_BLOCK
        pr, pc = (-rows) % b, (-cols) % b
        padded = mx.pad(weight, ((0, pr), (0, pc)))
        blocks = padded.reshape((rows + pr) // b, b, (cols + pc) // b, b)
        scaled = (blocks * scale_inv[:, None, :, None]).reshape(rows + pr, cols + pc)
        out[wk] = scaled[:rows, :cols].astype(mx.bfloat16)
    return out


def stack_experts(
    w: dict[str, mx.array], mlp: str, n_experts: int, projs: tuple[tuple[str, str], ...] = SWIGLU
) -> None:
    """``{mlp}.experts.{e}.{proj}.*`` -> ``{mlp}.switch_mlp.{name}.*`` [E, ...] for each
    ``(proj, name)`` of ``projs`` (mlx-lm's names), in place; only when every expert is there."""
    for proj, name in projs:
        for kind in ("weight", "scales", "biases"):
            keys = [f"{mlp}.experts.{e}.{proj}.{kind}" for e in range(n_experts)]
            if keys and all(k in w for k in keys):
                w[f"{mlp}.switch_mlp.{name}.{kind}"] = mx.stack([w.pop(k) for k in keys])


def split_kv_b(w: dict[str, mx.array], config: dict[str, Any], attention: str = "self_attn") -> None:
    """Split MLA's ``kv_b_proj`` [H*(nope+v), kv_rank] into per-head absorb matrices
    (``block.<attention>.embed_q`` / ``unembed_out``; Bailing names its attention ``attention``)."""
    key = f"block.{attention}.kv_b_proj.weight"
    if key not in w:
        return
    nope, vdim = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    heads = int(config["num_attention_heads"])
    v = w.pop(key)
    if v.ndim != 2 or v.shape[0] != heads * (nope + vdim):
        w[key] = v  # wrong shape: keep it so validation names it precisely
        return
    v = v.reshape(heads, nope + vdim, -1)
    w[f"block.{attention}.embed_q.weight"] = mx.contiguous(v[:, :nope, :].swapaxes(-1, -2))
    w[f"block.{attention}.unembed_out.weight"] = mx.contiguous(v[:, nope:, :])
