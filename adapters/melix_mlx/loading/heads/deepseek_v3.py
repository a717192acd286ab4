"""DeepSeek-V3 MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> MLA+MoE decoder layer
-> ``shared_head.norm`` -> ``shared_head.head``.

Rules:
- Concatenation is embedding first. The chained hidden is the PRE-norm decoder output
  (vLLM reuses the one layer on it and applies ``shared_head.norm`` only for logits).
- Raw keys: ``model.layers.{num_hidden_layers + j}.*``. ``embed_tokens`` there is a copy of
  the main embedding and is not loaded (the main one is shared). The decoder part maps to
  ``block.*`` (mlx-lm's ``DeepseekV3DecoderLayer``), and gets the same treatment mlx-lm's
  ``sanitize`` gives the main layers, which it skips for the head: fp8 block dequant,
  per-expert tensors stacked into ``switch_mlp``, ``kv_b_proj`` split into
  ``embed_q``/``unembed_out``.
- ``shared_head.head`` is the head's own output matrix when the checkpoint ships it
  (equal to the main lm_head in released checkpoints); with ``own_lm_head=False`` the
  main lm_head is used instead (saves vocab x hidden memory).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

from .trunk import FusedTrunkHead

_FP8_BLOCK = 128
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
_DROP = ("embed_tokens.", "rotary_emb.inv_freq")


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "deepseek_v3"
    CHAIN_POST_NORM: ClassVar[bool] = False  # the block output; shared_head.norm only for logits
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    HAS_OWN_LM_HEAD: ClassVar[bool] = True  # shared_head.head
    SHARED_HEAD_NORM: ClassVar[bool] = True
    MASK_ARRAY: ClassVar[bool] = True  # MLA

    def _make_block(self, args: Any) -> nn.Module:
        # index num_hidden_layers: mlx-lm then picks MoE exactly as HF does for the head
        return DeepseekV3DecoderLayer(args, layer_idx=args.num_hidden_layers)


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    n = int(config["num_hidden_layers"])
    if not key.startswith("model.layers."):
        return False
    idx = key.split(".", 3)[2]
    return idx.isdigit() and int(idx) >= n


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of MTP layer ``layer`` to ``MTPHead`` parameter names."""
    prefix = f"model.layers.{int(config['num_hidden_layers']) + layer}."
    w: dict[str, mx.array] = {}
    for key, value in raw.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if any(d in name for d in _DROP):
            continue
        w[name if name.startswith(_OWN) else f"block.{name}"] = value
    w = dequant_fp8(w)
    stack_experts(w, int(config.get("n_routed_experts") or 0))
    split_kv_b(w, config)
    return w


def dequant_fp8(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """Undo DeepSeek's fp8 storage: e4m3 weight times a per-128x128-block inverse scale."""
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


def stack_experts(w: dict[str, mx.array], n_experts: int) -> None:
    """``block.mlp.experts.{e}.{proj}.*`` -> ``block.mlp.switch_mlp.{proj}.*`` [E, ...]."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for kind in ("weight", "scales", "biases"):
            first = f"block.mlp.experts.0.{proj}.{kind}"
            if first not in w:
                continue
            keys = [f"block.mlp.experts.{e}.{proj}.{kind}" for e in range(n_experts)]
            if any(k not in w for k in keys):
                continue  # leave them: the shape check reports the missing experts
            w[f"block.mlp.switch_mlp.{proj}.{kind}"] = mx.stack([w.pop(k) for k in keys])


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
