"""A tiny Nemotron-H checkpoint in its Hugging Face layout (Mamba-2 hybrid with an MTP head).

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under
  the upstream HF names and conventions, head tensors included, the shared tokenizer.
- Config as Nemotron-3 checkpoints write it: flat, ``hybrid_override_pattern`` (one
  character per layer: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE) and
  ``mtp_hybrid_override_pattern`` = ``"*E"`` with ``num_nextn_predict_layers`` = 1. The
  newer spelling (``layers_block_type`` / ``mtp_layers_block_type`` lists, no pattern
  strings) is an override away: the builder reads whichever the config has.
- Main tensors: ``backbone.embeddings``, ``backbone.layers.{i}.norm`` and ``.mixer.*``
  (Mamba-2: ``in_proj``, ``conv1d`` weight stored [C, 1, K] and bias, ``dt_bias``,
  ``A_log``, ``D``, the gated ``norm``, ``out_proj``; attention: ``q/k/v/o_proj``; MLP:
  ``up_proj``/``down_proj`` (squared ReLU, no gate); MoE: ``gate.weight``,
  ``gate.e_score_correction_bias``, per-expert ``experts.{e}.{up,down}_proj``,
  ``shared_experts``, and ``fc1/fc2_latent_proj`` when ``moe_latent_size`` is set),
  ``backbone.norm_f``, ``lm_head``. Norms are plain weights near 1.
- Head tensors: ``mtp.layers.{i}`` per sub-layer of the MTP pattern, ``enorm``/``hnorm``/
  ``eh_proj`` on sub-layer 0 and ``final_layernorm`` on the last, inside
  ``model.safetensors`` (mlx-lm's ``sanitize`` drops every ``mtp.`` key, so its own loader
  reads the directory).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.nemotron_h import ModelArgs

from .tiny_layers import Init, lm_head
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

CONFIGS: dict[str, dict[str, Any]] = {
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "hybrid_override_pattern": "M-M*EM",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "chunk_size": 128,
        "time_step_limit": [0.0, float("inf")],
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": 1e-5,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*E",
        "max_position_embeddings": 4096,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    },
}
FAMILIES = tuple(CONFIGS)
HEAD_COUNT_KEY = {"nemotron_h": "num_nextn_predict_layers"}


def _pattern(c: dict, string_key: str, list_key: str) -> str:
    if c.get(string_key):
        return "".join(c[string_key])
    return "".join(ModelArgs._block_type_to_char[t] for t in c[list_key])


def _mamba(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d, heads, k = c["hidden_size"], c["mamba_num_heads"], c["conv_kernel"]
    inner = heads * c["mamba_head_dim"]
    conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]
    # dt in [time_step_min, time_step_max] log-uniformly; dt_bias is its softplus inverse
    dt = np.exp(init.rng.uniform(math.log(c["time_step_min"]), math.log(c["time_step_max"]), (heads,)))
    return {
        f"{p}.in_proj.weight": init.linear(inner + conv_dim + heads, d),
        f"{p}.conv1d.weight": init.normal((conv_dim, 1, k), 1.0 / math.sqrt(k)),  # HF [C, 1, K]
        f"{p}.conv1d.bias": init.normal((conv_dim,), 0.1),
        f"{p}.dt_bias": mx.array(dt + np.log(-np.expm1(-dt)), dtype=init.dtype),
        f"{p}.A_log": mx.log(mx.array(init.rng.uniform(1.0, 16.0, (heads,)), dtype=init.dtype)),
        f"{p}.D": init.norm(heads, one_plus=False),
        f"{p}.norm.weight": init.norm(inner, one_plus=False),
        f"{p}.out_proj.weight": init.linear(d, inner),
    }


def _attention(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    return {
        f"{p}.q_proj.weight": init.linear(h * hd, d),
        f"{p}.k_proj.weight": init.linear(kv * hd, d),
        f"{p}.v_proj.weight": init.linear(kv * hd, d),
        f"{p}.o_proj.weight": init.linear(d, h * hd),
    }


def _mlp(init: Init, p: str, d: int, inter: int) -> dict[str, mx.array]:
    return {f"{p}.up_proj.weight": init.linear(inter, d), f"{p}.down_proj.weight": init.linear(d, inter)}


def _moe(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d, e, inter = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    latent = c.get("moe_latent_size")
    width = latent or d
    w = {
        f"{p}.gate.weight": init.linear(e, d),
        f"{p}.gate.e_score_correction_bias": init.normal((e,), 0.1),
    }
    for j in range(e):  # HF stores one tensor per expert; mlx-lm's sanitize stacks them
        w.update(_mlp(init, f"{p}.experts.{j}", width, inter))
    w.update(_mlp(init, f"{p}.shared_experts", d, c["moe_shared_expert_intermediate_size"]))
    if latent:
        w[f"{p}.fc1_latent_proj.weight"] = init.linear(latent, d)
        w[f"{p}.fc2_latent_proj.weight"] = init.linear(d, latent)
    return w


def _block(init: Init, p: str, kind: str, c: dict) -> dict[str, mx.array]:
    mixer = f"{p}.mixer"
    if kind == "M":
        w = _mamba(init, mixer, c)
    elif kind == "*":
        w = _attention(init, mixer, c)
    elif kind == "-":
        w = _mlp(init, mixer, c["hidden_size"], c["intermediate_size"])
    else:
        w = _moe(init, mixer, c)
    w[f"{p}.norm.weight"] = init.norm(c["hidden_size"], one_plus=False)
    return w


def _nemotron_h_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v = c["hidden_size"], c["vocab_size"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"backbone.embeddings.weight": embed}
    for i, kind in enumerate(_pattern(c, "hybrid_override_pattern", "layers_block_type")):
        main.update(_block(init, f"backbone.layers.{i}", kind, c))
    main["backbone.norm_f.weight"] = init.norm(d, one_plus=False)
    main["lm_head.weight"] = lm_head(init, v, d, embed)
    sub = _pattern(c, "mtp_hybrid_override_pattern", "mtp_layers_block_type")
    head: dict[str, mx.array] = {}
    for j in range(c["num_nextn_predict_layers"]):
        for i, kind in enumerate(sub):
            head.update(_block(init, f"mtp.layers.{j * len(sub) + i}", kind, c))
        first, last = f"mtp.layers.{j * len(sub)}", f"mtp.layers.{(j + 1) * len(sub) - 1}"
        head[f"{first}.enorm.weight"] = init.norm(d, one_plus=False)
        head[f"{first}.hnorm.weight"] = init.norm(d, one_plus=False)
        head[f"{first}.eh_proj.weight"] = init.linear(d, 2 * d)
        head[f"{last}.final_layernorm.weight"] = init.norm(d, one_plus=False)
    return main, head


BUILDERS = {"nemotron_h": _nemotron_h_weights}
