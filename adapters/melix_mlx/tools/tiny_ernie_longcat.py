"""Tiny checkpoints of ERNIE-4.5 MoE and LongCat-Flash in their Hugging Face layout.

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under
  the upstream HF names and conventions, head tensors included, the shared tokenizer.
- ernie4_5_moe (ERNIE-4.5-21B-A3B / 300B-A47B ``-PT``): flat config with ``moe_*`` keys,
  a dense first layer then softmax-routed MoE layers (per-expert tensors, shared experts,
  ``mlp.moe_statics.e_score_correction_bias`` [1, E] which mlx-lm drops); head tensors
  ``model.mtp_emb_norm.{j}``, ``model.mtp_hidden_norm.{j}``, ``model.mtp_linear_proj.{j}``
  and a dense ``model.mtp_block.{j}`` decoder layer; ``num_nextn_predict_layers``.
- longcat_flash (LongCat-Flash-Chat): every layer holds two latent attentions
  (``self_attn.{0,1}`` with an unsplit ``kv_b_proj``), two dense MLPs (``mlps.{0,1}``),
  ``input_layernorm.{0,1}`` / ``post_attention_layernorm.{0,1}`` and one MoE with zero
  (identity) experts (``mlp.router.classifier``, ``mlp.router.e_score_correction_bias``,
  per-expert ``mlp.experts.{e}``). Head under ``model.mtp.``: ``embed_tokens`` (a copy),
  ``layers.0.{enorm.m, hnorm.m, eh_proj}``, one latent attention with
  ``input_layernorm`` / ``post_attention_layernorm``, a dense
  ``transformer_layer.mlp`` of ``ffn_hidden_size``, and ``norm``. Like the released
  config, the tiny one does not write a head count (one head layer is the default).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .tiny_layers import Init, lm_head, mlp
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

_COMMON = {"vocab_size": VOCAB_SIZE, "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}

CONFIGS: dict[str, dict[str, Any]] = {
    "ernie4_5_moe": {
        **_COMMON,
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000,
        "use_bias": False,
        "tie_word_embeddings": False,
        "moe_num_experts": 4,
        "moe_num_shared_experts": 1,
        "moe_k": 2,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
        "moe_intermediate_size": 32,
        "moe_capacity": [4, 4, 4],
        "moe_gate": "topk",
        "moe_use_aux_free": True,
        "num_nextn_predict_layers": 1,
        "multi_token_pred_lambda": 0.3,
    },
    "longcat_flash": {
        **_COMMON,
        "architectures": ["LongcatFlashForCausalLM"],
        "model_type": "longcat_flash",
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 32,
        "moe_topk": 2,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "num_layers": 2,
        "num_hidden_layers": 4,  # the HF config counts both attention sub-layers
        "num_attention_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "routed_scaling_factor": 6.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
        "norm_topk_prob": False,
        "router_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}

FAMILIES = tuple(CONFIGS)
HEAD_COUNT_KEY = {"ernie4_5_moe": "num_nextn_predict_layers", "longcat_flash": "num_nextn_predict_layers"}


# -- ernie4_5_moe --------------------------------------------------------------------------
def _ernie_layer(init: Init, p: str, c: dict, moe: bool) -> dict[str, mx.array]:
    d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    a = f"{p}.self_attn"
    w = {
        f"{a}.q_proj.weight": init.linear(h * hd, d),
        f"{a}.k_proj.weight": init.linear(kv * hd, d),
        f"{a}.v_proj.weight": init.linear(kv * hd, d),
        f"{a}.o_proj.weight": init.linear(d, h * hd),
        f"{p}.input_layernorm.weight": init.norm(d, one_plus=False),
        f"{p}.post_attention_layernorm.weight": init.norm(d, one_plus=False),
    }
    if not moe:
        w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
        return w
    n_exp, inter = c["moe_num_experts"], c["moe_intermediate_size"]
    w[f"{p}.mlp.gate.weight"] = init.linear(n_exp, d, gain=3.0)
    w[f"{p}.mlp.moe_statics.e_score_correction_bias"] = mx.zeros((1, n_exp), dtype=mx.float32)
    for e in range(n_exp):  # one tensor per expert, as HF stores them
        w.update(mlp(init, f"{p}.mlp.experts.{e}", d, inter))
    w.update(mlp(init, f"{p}.mlp.shared_experts", d, inter * c["moe_num_shared_experts"]))
    return w


def _ernie_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v = c["hidden_size"], c["vocab_size"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"model.embed_tokens.weight": embed}
    for i in range(c["num_hidden_layers"]):
        main.update(_ernie_layer(init, f"model.layers.{i}", c, moe=i >= c["moe_layer_start_index"]))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    if not c["tie_word_embeddings"]:
        main["lm_head.weight"] = lm_head(init, v, d, embed)
    head: dict[str, mx.array] = {}
    for j in range(c["num_nextn_predict_layers"]):
        head[f"model.mtp_emb_norm.{j}.weight"] = init.norm(d, one_plus=False)
        head[f"model.mtp_hidden_norm.{j}.weight"] = init.norm(d, one_plus=False)
        head[f"model.mtp_linear_proj.{j}.weight"] = init.linear(d, 2 * d)
        head.update(_ernie_layer(init, f"model.mtp_block.{j}", c, moe=False))
    return main, head


# -- longcat_flash -------------------------------------------------------------------------
def _mla(init: Init, a: str, c: dict) -> dict[str, mx.array]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vdim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    return {
        f"{a}.q_a_proj.weight": init.linear(qr, d),
        f"{a}.q_a_layernorm.weight": init.norm(qr, one_plus=False),
        f"{a}.q_b_proj.weight": init.linear(h * (nope + rope), qr),
        f"{a}.kv_a_proj_with_mqa.weight": init.linear(kvr + rope, d),
        f"{a}.kv_a_layernorm.weight": init.norm(kvr, one_plus=False),
        f"{a}.kv_b_proj.weight": init.linear(h * (nope + vdim), kvr),  # unsplit, as in HF
        f"{a}.o_proj.weight": init.linear(d, h * vdim, gain=0.5),
    }


def _longcat_layer(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d = c["hidden_size"]
    w: dict[str, mx.array] = {}
    for i in range(2):
        w.update(_mla(init, f"{p}.self_attn.{i}", c))
        w.update(mlp(init, f"{p}.mlps.{i}", d, c["ffn_hidden_size"]))
        w[f"{p}.input_layernorm.{i}.weight"] = init.norm(d, one_plus=False)
        w[f"{p}.post_attention_layernorm.{i}.weight"] = init.norm(d, one_plus=False)
    n_all = c["n_routed_experts"] + c["zero_expert_num"]
    w[f"{p}.mlp.router.classifier.weight"] = init.linear(n_all, d, gain=3.0)
    w[f"{p}.mlp.router.e_score_correction_bias"] = mx.zeros((n_all,), dtype=mx.float32)
    for e in range(c["n_routed_experts"]):
        w.update(mlp(init, f"{p}.mlp.experts.{e}", d, c["expert_ffn_hidden_size"]))
    return w


def _longcat_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v = c["hidden_size"], c["vocab_size"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"model.embed_tokens.weight": embed}
    for i in range(c["num_layers"]):
        main.update(_longcat_layer(init, f"model.layers.{i}", c))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    main["lm_head.weight"] = lm_head(init, v, d, embed)
    p = "model.mtp.layers.0"
    head = _mla(init, f"{p}.self_attn", c)
    head.update(mlp(init, f"{p}.transformer_layer.mlp", d, c["ffn_hidden_size"]))
    head.update(
        {
            "model.mtp.embed_tokens.weight": embed,  # a copy of the shared embedding
            f"{p}.enorm.m.weight": init.norm(d, one_plus=False),
            f"{p}.hnorm.m.weight": init.norm(d, one_plus=False),
            f"{p}.eh_proj.weight": init.linear(d, 2 * d),
            f"{p}.input_layernorm.weight": init.norm(d, one_plus=False),
            f"{p}.post_attention_layernorm.weight": init.norm(d, one_plus=False),
            "model.mtp.norm.weight": init.norm(d, one_plus=False),
        }
    )
    return main, head


BUILDERS = {"ernie4_5_moe": _ernie_weights, "longcat_flash": _longcat_weights}
