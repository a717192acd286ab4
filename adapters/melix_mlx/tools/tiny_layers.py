"""Seeded tensors and the layer weights the tiny checkpoints share (melix_mlx.tools.tiny builds
the dense families, melix_mlx.tools.tiny_moe the MoE ones, both from these parts).

Weights are in the real Hugging Face layout of each family; nothing here writes files.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .tiny_tokenizer import special_token_ids


class Init:
    """Seeded tensor factory; Linear weights ~ N(0, gain^2 / fan_in)."""

    def __init__(self, seed: int, dtype: mx.Dtype) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype

    def _arr(self, x: np.ndarray) -> mx.array:
        return mx.array(x.astype(np.float32)).astype(self.dtype)

    def linear(self, out_dim: int, in_dim: int, gain: float = 1.0) -> mx.array:
        std = gain / math.sqrt(in_dim)
        return self._arr(self.rng.normal(0.0, std, (out_dim, in_dim)))

    def normal(self, shape: tuple[int, ...], std: float) -> mx.array:
        return self._arr(self.rng.normal(0.0, std, shape))

    def norm(self, dim: int, one_plus: bool) -> mx.array:
        # (1+w) norms store w near 0; plain norms store a weight near 1.
        w = self.rng.normal(0.0, 0.1, (dim,))
        return self._arr(w if one_plus else 1.0 + w)


def mlp(init: Init, p: str, d: int, inter: int) -> dict[str, mx.array]:
    return {
        f"{p}.gate_proj.weight": init.linear(inter, d),
        f"{p}.up_proj.weight": init.linear(inter, d),
        f"{p}.down_proj.weight": init.linear(d, inter),
    }


def qwen3_5_full_attn(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    return {
        f"{p}.q_proj.weight": init.linear(2 * h * hd, d),  # queries and output gate
        f"{p}.k_proj.weight": init.linear(kv * hd, d),
        f"{p}.v_proj.weight": init.linear(kv * hd, d),
        f"{p}.o_proj.weight": init.linear(d, h * hd),
        f"{p}.q_norm.weight": init.norm(hd, one_plus=True),
        f"{p}.k_norm.weight": init.norm(hd, one_plus=True),
    }


def qwen3_5_linear_attn(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d = c["hidden_size"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    conv_dim, k = 2 * kd + vd, c["linear_conv_kernel_dim"]
    return {
        f"{p}.in_proj_qkv.weight": init.linear(conv_dim, d),
        f"{p}.in_proj_z.weight": init.linear(vd, d),
        f"{p}.in_proj_b.weight": init.linear(nv, d),
        f"{p}.in_proj_a.weight": init.linear(nv, d),
        f"{p}.conv1d.weight": init.normal((conv_dim, 1, k), 1.0 / math.sqrt(k)),  # HF [C,1,K]
        f"{p}.dt_bias": init.normal((nv,), 0.5) + 1.0,
        f"{p}.A_log": mx.log(mx.array(init.rng.uniform(1.0, 16.0, (nv,)), dtype=init.dtype)),
        # the gated norm is a plain weight (not 1+w) in HF as well
        f"{p}.norm.weight": init.norm(c["linear_value_head_dim"], one_plus=False),
        f"{p}.out_proj.weight": init.linear(d, vd),
    }


def lm_head(init: Init, vocab: int, dim: int, embed: mx.array) -> mx.array:
    """Untied output matrix: random (gain 4, so argmax moves every step) minus the
    normalised input embedding, which discourages the token -> same token fixed points
    that make random models repeat one token forever."""
    w = init.linear(vocab, dim, gain=4.0) - embed / math.sqrt(dim)
    # zero rows for special tokens: greedy runs then rarely stop early on EOS
    return w.at[mx.array(special_token_ids())].multiply(0.0)
