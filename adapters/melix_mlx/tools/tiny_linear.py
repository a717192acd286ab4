"""Tiny checkpoints of the linear-attention hybrids (Ling V3, Ling 2.5) in their HF layout.

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): flat config.json with
  the keys the published configs carry, seeded weights under the upstream HF names and
  conventions, head tensors included, the shared tokenizer.
- bailing_moe_v3 (Ling V3, ``BailingMoeV3ForCausalLM``): groups of ``layer_group_size``
  layers whose last is latent attention (MLA with a per-head output gate ``g_proj``,
  output ``dense``, ``kv_b_proj`` unsplit) and the others Kimi delta attention (separate
  q/k/v projections and depthwise convolutions stored [C, 1, K], ``A_log``, ``dt_bias``,
  ``f_proj``, ``b_proj``, ``g_proj``, ``o_norm``); a dense first layer, then MoE with a
  router ``mlp.gate.weight`` / ``mlp.gate.expert_bias``, per-expert tensors and shared
  experts. Embedding ``model.word_embeddings``. Head at ``model.layers.{N + j}``:
  ``enorm``, ``hnorm``, ``eh_proj``, an MLA + MoE decoder layer under the main layers'
  names, ``final_layernorm``; no output matrix of its own (the main ``lm_head``).
- bailing_hybrid (Ling 2.5, ``BailingMoeV2_5ForCausalLM``): the same grouping with
  lightning attention (fused ``query_key_value``, q/k norms, ``g_proj``, grouped
  ``g_norm``, ``dense``) and MLA without output gate; router ``mlp.gate.weight`` /
  ``mlp.gate.expert_bias``. Head as above plus ``shared_head.norm`` (deepseek_mtp's
  shared head, applied after ``final_layernorm``).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from .tiny_layers import Init, lm_head, mlp
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_group_size": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "moe_router_enable_expert_bias": True,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "use_qkv_bias": False,
    "use_bias": False,
    "hidden_act": "silu",
    "bos_token_id": EOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": EOS_TOKEN_ID,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "bailing_moe_v3": {
        "architectures": ["BailingMoeV3ForCausalLM"],
        "model_type": "bailing_moe_v3",
        **_COMMON,
        "short_conv_kernel_size": 4,
        "kda_lower_bound": -5.0,
        "kda_safe_gate": True,
        "no_kda_lora": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "mtp_use_kda": False,
        "mtp_loss_scaling_factor": 0,
    },
    "bailing_hybrid": {
        "architectures": ["BailingMoeV2_5ForCausalLM"],
        "model_type": "bailing_hybrid",
        **_COMMON,
        "group_norm_size": 2,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
    },
}
FAMILIES = tuple(CONFIGS)
HEAD_COUNT_KEY = {family: "num_nextn_predict_layers" for family in FAMILIES}


def _is_linear(i: int, c: dict) -> bool:
    group, n = c["layer_group_size"], c["num_hidden_layers"]
    return not ((i + 1) % group == 0 or i >= n // group * group)


def _mla(init: Init, a: str, c: dict, gate: bool) -> dict[str, mx.array]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vdim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    w = {
        f"{a}.q_a_proj.weight": init.linear(qr, d),
        f"{a}.q_a_layernorm.weight": init.norm(qr, one_plus=False),
        f"{a}.q_b_proj.weight": init.linear(h * (nope + rope), qr),
        f"{a}.kv_a_proj_with_mqa.weight": init.linear(kvr + rope, d),
        f"{a}.kv_a_layernorm.weight": init.norm(kvr, one_plus=False),
        f"{a}.kv_b_proj.weight": init.linear(h * (nope + vdim), kvr),  # unsplit, as in HF
        f"{a}.dense.weight": init.linear(d, h * vdim),
    }
    if gate:
        w[f"{a}.g_proj.weight"] = init.linear(h, d)
    return w


def _kda(init: Init, a: str, c: dict) -> dict[str, mx.array]:
    d, h, hd, k = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["short_conv_kernel_size"]
    p = h * hd
    w = {f"{a}.{x}_proj.weight": init.linear(p, d) for x in ("q", "k", "v", "f", "g")}
    for x in ("q", "k", "v"):
        w[f"{a}.{x}_conv1d.weight"] = init.normal((p, 1, k), 1.0 / math.sqrt(k))  # HF [C, 1, K]
    w[f"{a}.A_log"] = mx.log(mx.array(init.rng.uniform(1.0, 16.0, (h,)), dtype=mx.float32))
    w[f"{a}.dt_bias"] = init.normal((p,), 0.5).astype(mx.float32)
    w[f"{a}.b_proj.weight"] = init.linear(h, d)
    w[f"{a}.o_norm.weight"] = init.norm(hd, one_plus=False)
    w[f"{a}.o_proj.weight"] = init.linear(d, p)
    return w


def _lightning(init: Init, a: str, c: dict) -> dict[str, mx.array]:
    d, h, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    return {
        f"{a}.query_key_value.weight": init.linear(3 * h * hd, d),
        f"{a}.query_layernorm.weight": init.norm(hd, one_plus=False),
        f"{a}.key_layernorm.weight": init.norm(hd, one_plus=False),
        f"{a}.g_proj.weight": init.linear(h * hd, d),
        f"{a}.g_norm.weight": init.norm(h * hd, one_plus=False),
        f"{a}.dense.weight": init.linear(d, h * hd),
    }


def _layer(init: Init, p: str, c: dict, i: int, family: str) -> dict[str, mx.array]:
    d, v3 = c["hidden_size"], family == "bailing_moe_v3"
    if i < c["num_hidden_layers"] and _is_linear(i, c):
        w = _kda(init, f"{p}.attention", c) if v3 else _lightning(init, f"{p}.attention", c)
    else:  # the full-attention layers, and every head layer
        w = _mla(init, f"{p}.attention", c, gate=v3)
    w[f"{p}.input_layernorm.weight"] = init.norm(d, one_plus=False)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(d, one_plus=False)
    if i < c["first_k_dense_replace"]:
        w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
        return w
    n_exp = c["num_experts"]
    w[f"{p}.mlp.gate.weight"] = init.linear(n_exp, d)
    w[f"{p}.mlp.gate.expert_bias"] = init.normal((n_exp,), 0.1).astype(mx.float32)
    for e in range(n_exp):  # one tensor per expert, as HF stores them
        w.update(mlp(init, f"{p}.mlp.experts.{e}", d, c["moe_intermediate_size"]))
    shared = c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"]
    w.update(mlp(init, f"{p}.mlp.shared_experts", d, shared))
    return w


def _weights(family: str):
    def build(init: Init, c: dict) -> tuple[dict, dict]:
        d, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
        embed = init.normal((v, d), 1.0)
        main: dict[str, mx.array] = {"model.word_embeddings.weight": embed}
        for i in range(n):
            main.update(_layer(init, f"model.layers.{i}", c, i, family))
        main["model.norm.weight"] = init.norm(d, one_plus=False)
        main["lm_head.weight"] = lm_head(init, v, d, embed)
        head: dict[str, mx.array] = {}
        for j in range(c["num_nextn_predict_layers"]):
            p = f"model.layers.{n + j}"
            head.update(_layer(init, p, c, n + j, family))
            head[f"{p}.enorm.weight"] = init.norm(d, one_plus=False)
            head[f"{p}.hnorm.weight"] = init.norm(d, one_plus=False)
            head[f"{p}.eh_proj.weight"] = init.linear(d, 2 * d)
            head[f"{p}.final_layernorm.weight"] = init.norm(d, one_plus=False)
            if family == "bailing_hybrid":
                head[f"{p}.shared_head.norm.weight"] = init.norm(d, one_plus=False)
        return main, head

    return build


BUILDERS = {family: _weights(family) for family in FAMILIES}
