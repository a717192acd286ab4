"""Tiny checkpoints of the MoE families in their real Hugging Face layout.

(Configs of the core families, deepseek_v3 among them, stay in ``melix_mlx.tools.tiny``; the
weight builders of every MoE layout are here.)

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under the
  upstream HF names and conventions, head tensors included, the shared tokenizer.
- glm4_moe (GLM-4.5/4.6): GQA attention with q/k/v biases and partial RoPE, a dense first
  layer then sigmoid-routed MoE layers (per-expert tensors, ``e_score_correction_bias``,
  shared experts); head at ``model.layers.{num_hidden_layers + j}`` with DeepSeek-style
  ``enorm``/``hnorm``/``eh_proj``/``shared_head`` and copies of embedding and lm_head.
- glm4_moe_lite (GLM-4.7-Flash): DeepSeek-V3's names and conventions (latent attention
  with an unsplit ``kv_b_proj``, per-expert MoE), head at ``model.layers.{N + j}``.
- qwen3_5_moe (Qwen3.6-35B-A3B): the Qwen3.5 hybrid under ``model.language_model.`` with
  MoE feed-forwards stored fused (``experts.gate_up_proj`` [E, 2I, D],
  ``experts.down_proj`` [E, D, I]) plus ``shared_expert`` and ``shared_expert_gate``;
  ``mtp.*`` head whose layer is MoE too. (1+w) norms stored as w.
- qwen3_next: flat config, ``model.`` prefix, linear attention with fused
  ``in_proj_qkvz`` / ``in_proj_ba``, per-expert MoE tensors; ``mtp.*`` head.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from .tiny_layers import Init, lm_head, mlp, qwen3_5_full_attn, qwen3_5_linear_attn
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

_COMMON = {"vocab_size": VOCAB_SIZE, "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}
_HYBRID = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
}

CONFIGS: dict[str, dict[str, Any]] = {
    "glm4_moe": {
        **_COMMON,
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "use_qk_norm": False,
        "attention_bias": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    "glm4_moe_lite": {
        **_COMMON,
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.8,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "partial_rotary_factor": 1.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen3_5_moe": {
        **_COMMON,
        **_HYBRID,
        "model_type": "qwen3_5_moe_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [1, 1, 0],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
    },
    "qwen3_next": {
        **_COMMON,
        **_HYBRID,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_scaling": None,
    },
}

HEAD_COUNT_KEY = {"glm4_moe": "num_nextn_predict_layers"}  # others: mtp_num_hidden_layers


def wrap_config(family: str, text: dict[str, Any]) -> dict[str, Any]:
    """The config.json holding ``text`` (nested for qwen3_5_moe, flat otherwise)."""
    if family != "qwen3_5_moe":
        return text
    n, every = text["num_hidden_layers"], text["full_attention_interval"]
    text["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "language_model_only": True,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }


def _norm1p(init: Init, dim: int) -> mx.array:
    return init.norm(dim, one_plus=True)


# -- deepseek_v3 (and glm4_moe_lite, which keeps its names) ------------------------------
def _deepseek_layer(init: Init, p: str, c: dict, moe: bool) -> dict[str, mx.array]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vdim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    a = f"{p}.self_attn"
    w = {
        f"{a}.q_a_proj.weight": init.linear(qr, d),
        f"{a}.q_a_layernorm.weight": init.norm(qr, one_plus=False),
        f"{a}.q_b_proj.weight": init.linear(h * (nope + rope), qr),
        f"{a}.kv_a_proj_with_mqa.weight": init.linear(kvr + rope, d),
        f"{a}.kv_a_layernorm.weight": init.norm(kvr, one_plus=False),
        f"{a}.kv_b_proj.weight": init.linear(h * (nope + vdim), kvr),  # unsplit, as in HF
        f"{a}.o_proj.weight": init.linear(d, h * vdim),
        f"{p}.input_layernorm.weight": init.norm(d, one_plus=False),
        f"{p}.post_attention_layernorm.weight": init.norm(d, one_plus=False),
    }
    if not moe:
        w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
        return w
    n_exp, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    w[f"{p}.mlp.gate.weight"] = init.linear(n_exp, d)
    w[f"{p}.mlp.gate.e_score_correction_bias"] = mx.zeros((n_exp,), dtype=mx.float32)
    for e in range(n_exp):  # one tensor per expert, as HF stores them
        w.update(mlp(init, f"{p}.mlp.experts.{e}", d, inter))
    w.update(mlp(init, f"{p}.mlp.shared_experts", d, inter * c["n_shared_experts"]))
    return w


def deepseek_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"model.embed_tokens.weight": embed}
    for i in range(n):
        moe = i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0
        main.update(_deepseek_layer(init, f"model.layers.{i}", c, moe))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    main["lm_head.weight"] = lm_head(init, v, d, embed)
    head: dict[str, mx.array] = {}
    for j in range(c["num_nextn_predict_layers"]):
        p = f"model.layers.{n + j}"
        head.update(_deepseek_layer(init, p, c, moe=True))
        head[f"{p}.embed_tokens.weight"] = embed  # DeepSeek ships copies of the shared ones
        head[f"{p}.enorm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.hnorm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.eh_proj.weight"] = init.linear(d, 2 * d)
        head[f"{p}.shared_head.norm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.shared_head.head.weight"] = main["lm_head.weight"]
    return main, head


# -- glm4_moe ------------------------------------------------------------------------------
def _glm_layer(init: Init, p: str, c: dict, moe: bool) -> dict[str, mx.array]:
    d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    a = f"{p}.self_attn"
    w = {
        f"{a}.q_proj.weight": init.linear(h * hd, d),
        f"{a}.q_proj.bias": init.normal((h * hd,), 0.1),
        f"{a}.k_proj.weight": init.linear(kv * hd, d),
        f"{a}.k_proj.bias": init.normal((kv * hd,), 0.1),
        f"{a}.v_proj.weight": init.linear(kv * hd, d),
        f"{a}.v_proj.bias": init.normal((kv * hd,), 0.1),
        f"{a}.o_proj.weight": init.linear(d, h * hd),
        f"{p}.input_layernorm.weight": init.norm(d, one_plus=False),
        f"{p}.post_attention_layernorm.weight": init.norm(d, one_plus=False),
    }
    if c["use_qk_norm"]:
        w[f"{a}.q_norm.weight"] = init.norm(hd, one_plus=False)
        w[f"{a}.k_norm.weight"] = init.norm(hd, one_plus=False)
    if not moe:
        w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
        return w
    n_exp, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    w[f"{p}.mlp.gate.weight"] = init.linear(n_exp, d)
    w[f"{p}.mlp.gate.e_score_correction_bias"] = mx.zeros((n_exp,), dtype=mx.float32)
    for e in range(n_exp):
        w.update(mlp(init, f"{p}.mlp.experts.{e}", d, inter))
    w.update(mlp(init, f"{p}.mlp.shared_experts", d, inter * c["n_shared_experts"]))
    return w


def _glm4_moe_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"model.embed_tokens.weight": embed}
    for i in range(n):
        main.update(_glm_layer(init, f"model.layers.{i}", c, moe=i >= c["first_k_dense_replace"]))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    main["lm_head.weight"] = lm_head(init, v, d, embed)
    head: dict[str, mx.array] = {}
    for j in range(c["num_nextn_predict_layers"]):
        p = f"model.layers.{n + j}"
        head.update(_glm_layer(init, p, c, moe=True))
        head[f"{p}.embed_tokens.weight"] = embed
        head[f"{p}.enorm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.hnorm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.eh_proj.weight"] = init.linear(d, 2 * d)
        head[f"{p}.shared_head.norm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.shared_head.head.weight"] = main["lm_head.weight"]
    return main, head


# -- Qwen hybrids with MoE -----------------------------------------------------------------
def _sparse_moe(init: Init, p: str, c: dict, fused: bool) -> dict[str, mx.array]:
    d, n_exp, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    w = {f"{p}.gate.weight": init.linear(n_exp, d), f"{p}.shared_expert_gate.weight": init.linear(1, d)}
    w.update(mlp(init, f"{p}.shared_expert", d, c["shared_expert_intermediate_size"]))
    if fused:  # [E, 2I, D] gate rows then up rows, and [E, D, I]
        w[f"{p}.experts.gate_up_proj"] = init.normal((n_exp, 2 * inter, d), 1.0 / math.sqrt(d))
        w[f"{p}.experts.down_proj"] = init.normal((n_exp, d, inter), 1.0 / math.sqrt(inter))
    else:
        for e in range(n_exp):
            w.update(mlp(init, f"{p}.experts.{e}", d, inter))
    return w


def _next_linear_attn(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    """Qwen3-Next's fused projections in place of Qwen3.5's split ones."""
    w = qwen3_5_linear_attn(init, p, c)
    qkv, z = w.pop(f"{p}.in_proj_qkv.weight"), w.pop(f"{p}.in_proj_z.weight")
    b, a = w.pop(f"{p}.in_proj_b.weight"), w.pop(f"{p}.in_proj_a.weight")
    # row order is per key-head groups [q, k, v, z] / [b, a]; random rows need no regrouping
    w[f"{p}.in_proj_qkvz.weight"] = mx.concatenate([qkv, z])
    w[f"{p}.in_proj_ba.weight"] = mx.concatenate([b, a])
    return w


def _hybrid_layer(init: Init, p: str, c: dict, full: bool, family: str) -> dict[str, mx.array]:
    d = c["hidden_size"]
    if full:
        w = qwen3_5_full_attn(init, f"{p}.self_attn", c)
    elif family == "qwen3_next":
        w = _next_linear_attn(init, f"{p}.linear_attn", c)
    else:
        w = qwen3_5_linear_attn(init, f"{p}.linear_attn", c)
    w.update(_sparse_moe(init, f"{p}.mlp", c, fused=family == "qwen3_5_moe"))
    w[f"{p}.input_layernorm.weight"] = _norm1p(init, d)
    w[f"{p}.post_attention_layernorm.weight"] = _norm1p(init, d)
    return w


def _hybrid_weights(family: str):
    def build(init: Init, c: dict) -> tuple[dict, dict]:
        d, v = c["hidden_size"], c["vocab_size"]
        root = "model.language_model" if family == "qwen3_5_moe" else "model"
        embed = init.normal((v, d), 1.0)
        main: dict[str, mx.array] = {f"{root}.embed_tokens.weight": embed}
        for i in range(c["num_hidden_layers"]):
            full = (i + 1) % c["full_attention_interval"] == 0
            main.update(_hybrid_layer(init, f"{root}.layers.{i}", c, full, family))
        main[f"{root}.norm.weight"] = _norm1p(init, d)
        main["lm_head.weight"] = lm_head(init, v, d, embed)
        head = {
            "mtp.fc.weight": init.linear(d, 2 * d),
            "mtp.pre_fc_norm_embedding.weight": _norm1p(init, d),
            "mtp.pre_fc_norm_hidden.weight": _norm1p(init, d),
            "mtp.norm.weight": _norm1p(init, d),
        }
        for j in range(c["mtp_num_hidden_layers"]):
            head.update(_hybrid_layer(init, f"mtp.layers.{j}", c, True, family))
        return main, head

    return build


def _glm4_moe_lite_weights(init: Init, c: dict) -> tuple[dict, dict]:
    """DeepSeek-V3's HF names and conventions (MLA with unsplit ``kv_b_proj``, per-expert MoE)."""
    return deepseek_weights(init, c)


BUILDERS = {
    "deepseek_v3": deepseek_weights,
    "glm4_moe": _glm4_moe_weights,
    "glm4_moe_lite": _glm4_moe_lite_weights,
    "qwen3_5_moe": _hybrid_weights("qwen3_5_moe"),
    "qwen3_next": _hybrid_weights("qwen3_next"),
}
