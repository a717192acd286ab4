"""Tiny checkpoints of the sliding-window MTP families in their Hugging Face layout.

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under
  the upstream HF names and conventions, head tensors included, the shared tokenizer.
  Every family's window is 8 positions, so prompts and outputs of a few dozen tokens
  cross it many times.
- mimo_v2_flash (MiMo-V2-Flash): ``hybrid_layer_pattern`` (1 = sliding window), full and
  sliding attention with their own head counts and dims (q/k 24, v 16), partial RoPE,
  attention sink biases on the sliding layers, a dense first layer then sigmoid-routed
  MoE layers (per-expert tensors, ``mlp.gate.e_score_correction_bias``, no shared
  experts). Head under ``model.mtp.layers.{j}``: ``enorm``, ``hnorm``, ``eh_proj``, a
  sliding-window attention (``self_attn.*`` with its sink bias), ``input_layernorm``,
  ``pre_mlp_layernorm``, a dense ``mlp`` and ``final_layernorm``. Like the released
  config, no head-count key (one head layer is read).
- step3p5 (Step-3.5-Flash): ``layer_types`` / ``rope_theta`` / ``partial_rotary_factors``
  sized over the decoder plus its MTP layers, sliding layers with their own head count
  (``attention_other_setting``), head-wise attention gates (``g_proj``), zero-centred
  norms stored as w (the model computes with 1 + w), MoE layers in the packed HF form
  (``moe.{gate,up,down}_proj`` [E, ...], ``moe.gate``, ``moe.router_bias``,
  ``share_expert``). Head at ``model.layers.{num_hidden_layers + j}``: ``enorm``,
  ``hnorm``, ``eh_proj``, a sliding dense decoder layer and ``shared_head.{norm,output}``.
- exaone_moe (K-EXAONE): ``layer_types`` (sliding, full), ``is_moe_layer``, q/k norms,
  RoPE on sliding layers only, MoE with a shared expert and the correction bias at
  ``mlp.e_score_correction_bias``. Head under ``mtp.``: ``fc``,
  ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.{j}`` (a dense decoder
  layer, ``mtp_layer_types: ["full_attention"]`` as released) and ``norm``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .tiny_layers import Init, lm_head, mlp
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

WINDOW = 8
_COMMON = {"vocab_size": VOCAB_SIZE, "bos_token_id": EOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}

CONFIGS: dict[str, dict[str, Any]] = {
    "mimo_v2_flash": {
        **_COMMON,
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "hybrid_layer_pattern": [0, 1, 1, 0],
        "moe_layer_freq": [0, 1, 1, 1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "v_head_dim": 16,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": 24,
        "swa_v_head_dim": 16,
        "partial_rotary_factor": 0.334,
        "rope_theta": 5000000,
        "swa_rope_theta": 10000,
        "sliding_window": WINDOW,
        "sliding_window_size": WINDOW,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.707,
        "attention_bias": False,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": None,
        "routed_scaling_factor": None,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "layernorm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    "step3p5": {
        **_COMMON,
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 16,
        "att_impl_type": "GQA",
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 6,
            "num_attention_groups": 2,
            "head_dim": 16,
        },
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
        "rope_theta": [5000000.0, 10000.0, 10000.0, 10000.0],
        "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0],
        "sliding_window": WINDOW,
        "use_head_wise_attn_gate": True,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "moe_router_activation": "sigmoid",
        "moe_layers_enum": "1,2",
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 32,
        "share_expert_dim": 32,
        "moe_router_scaling_factor": 3.0,
        "norm_expert_weight": True,
        "swiglu_limits": [0.0, 0.0, 7.0, 0.0],
        "swiglu_limits_shared": [0.0, 0.0, 0.0, 0.0],
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "exaone_moe": {
        **_COMMON,
        "architectures": ["ExaoneMoEForCausalLM"],
        "model_type": "exaone_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "is_moe_layer": [False, True, True, True],
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "sliding_window_pattern": "LLLG",
        "num_nextn_predict_layers": 1,
        "mtp_layer_types": ["full_attention"],
        "mtp_sliding_windows": [0],
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}

FAMILIES = tuple(CONFIGS)
# per-layer settings, sized num_hidden_layers (+ the head layers for step3p5, which lists
# them too): `fit_layers` cycles the main layers' pattern when the layer count is changed
PER_LAYER = (
    "layer_types",
    "rope_theta",
    "partial_rotary_factors",
    "swiglu_limits",
    "swiglu_limits_shared",
    "hybrid_layer_pattern",
    "moe_layer_freq",
    "is_moe_layer",
)


def fit_layers(family: str, text: dict[str, Any]) -> dict[str, Any]:
    """`text` with every per-layer list sized to its `num_hidden_layers` (widened benches)."""
    before = CONFIGS[family]["num_hidden_layers"]
    n = text["num_hidden_layers"]
    if n == before:
        return text
    for key in PER_LAYER:
        values = text.get(key)
        if not isinstance(values, list) or len(values) < before:
            continue
        main, tail = values[:before], values[before:]  # tail: the head layers' entries
        text[key] = [main[i % before] for i in range(n)] + tail
    if family == "step3p5":  # its MoE layers are named by index
        text["moe_layers_enum"] = ",".join(str(i) for i in range(1, n))
    return text


HEAD_COUNT_KEY = {
    "mimo_v2_flash": "num_nextn_predict_layers",
    "step3p5": "num_nextn_predict_layers",
    "exaone_moe": "num_nextn_predict_layers",
}


def _attn(init: Init, p: str, d: int, heads: int, kv: int, qk: int, v: int) -> dict[str, mx.array]:
    return {
        f"{p}.q_proj.weight": init.linear(heads * qk, d),
        f"{p}.k_proj.weight": init.linear(kv * qk, d),
        f"{p}.v_proj.weight": init.linear(kv * v, d),
        f"{p}.o_proj.weight": init.linear(d, heads * v),
    }


def _experts(init: Init, p: str, d: int, n: int, inter: int) -> dict[str, mx.array]:
    w: dict[str, mx.array] = {}
    for e in range(n):
        w.update(mlp(init, f"{p}.experts.{e}", d, inter))
    return w


def _main_and_head(init: Init, c: dict, embed_key: str) -> tuple[dict, mx.array]:
    d, v = c["hidden_size"], c["vocab_size"]
    embed = init.normal((v, d), 1.0)
    return {embed_key: embed, "lm_head.weight": lm_head(init, v, d, embed)}, embed


# -- mimo_v2_flash -----------------------------------------------------------------------
def _mimo_attn(init: Init, p: str, c: dict, sliding: bool) -> dict[str, mx.array]:
    pre = "swa_" if sliding else ""
    w = _attn(
        init,
        p,
        c["hidden_size"],
        c[f"{pre}num_attention_heads"],
        c[f"{pre}num_key_value_heads"],
        c[f"{pre}head_dim"],
        c[f"{pre}v_head_dim"],
    )
    sink = c["add_swa_attention_sink_bias"] if sliding else c["add_full_attention_sink_bias"]
    if sink:
        w[f"{p}.attention_sink_bias"] = init.normal((c[f"{pre}num_attention_heads"],), 0.5)
    return w


def _mimo_v2_flash_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d = c["hidden_size"]
    main, _ = _main_and_head(init, c, "model.embed_tokens.weight")
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        main.update(_mimo_attn(init, f"{p}.self_attn", c, c["hybrid_layer_pattern"][i] == 1))
        main[f"{p}.input_layernorm.weight"] = init.norm(d, one_plus=False)
        main[f"{p}.post_attention_layernorm.weight"] = init.norm(d, one_plus=False)
        if c["moe_layer_freq"][i]:
            n = c["n_routed_experts"]
            main[f"{p}.mlp.gate.weight"] = init.linear(n, d)
            main[f"{p}.mlp.gate.e_score_correction_bias"] = init.normal((n,), 0.1)
            main.update(_experts(init, f"{p}.mlp", d, n, c["moe_intermediate_size"]))
        else:
            main.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    head: dict[str, mx.array] = {}
    for j in range(c.get("num_nextn_predict_layers", 1)):
        p = f"model.mtp.layers.{j}"
        for name in ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm", "final_layernorm"):
            head[f"{p}.{name}.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.eh_proj.weight"] = init.linear(d, 2 * d)
        head.update(_mimo_attn(init, f"{p}.self_attn", c, sliding=True))
        head.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
    return main, head


# -- step3p5 -----------------------------------------------------------------------------
def _step_layer(init: Init, p: str, c: dict, i: int, moe: bool) -> dict[str, mx.array]:
    d, hd = c["hidden_size"], c["head_dim"]
    other = c["attention_other_setting"]
    sliding = c["layer_types"][i] == other["attention_type"]
    heads = other["num_attention_heads"] if sliding else c["num_attention_heads"]
    kv = other["num_attention_groups"] if sliding else c["num_attention_groups"]
    a = f"{p}.self_attn"
    w = _attn(init, a, d, heads, kv, hd, hd)
    w[f"{a}.g_proj.weight"] = init.linear(heads, d)
    w[f"{a}.q_norm.weight"] = init.norm(hd, one_plus=True)
    w[f"{a}.k_norm.weight"] = init.norm(hd, one_plus=True)
    w[f"{p}.input_layernorm.weight"] = init.norm(d, one_plus=True)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(d, one_plus=True)
    if not moe:
        w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
        return w
    n, inter = c["moe_num_experts"], c["moe_intermediate_size"]
    w[f"{p}.moe.gate.weight"] = init.linear(n, d)
    w[f"{p}.moe.router_bias"] = init.normal((n,), 0.1)
    w[f"{p}.moe.gate_proj.weight"] = mx.stack([init.linear(inter, d) for _ in range(n)])
    w[f"{p}.moe.up_proj.weight"] = mx.stack([init.linear(inter, d) for _ in range(n)])
    w[f"{p}.moe.down_proj.weight"] = mx.stack([init.linear(d, inter) for _ in range(n)])
    w.update(mlp(init, f"{p}.share_expert", d, c["share_expert_dim"]))
    return w


def _step3p5_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, layers = c["hidden_size"], c["num_hidden_layers"]
    moe = {int(i) for i in c["moe_layers_enum"].split(",")}
    main, _ = _main_and_head(init, c, "model.embed_tokens.weight")
    for i in range(layers):
        main.update(_step_layer(init, f"model.layers.{i}", c, i, i in moe))
    main["model.norm.weight"] = init.norm(d, one_plus=True)
    head: dict[str, mx.array] = {}
    for j in range(c["num_nextn_predict_layers"]):
        i = layers + j
        p = f"model.layers.{i}"
        head.update(_step_layer(init, p, c, i, moe=False))
        for name in ("enorm", "hnorm", "shared_head.norm"):
            head[f"{p}.{name}.weight"] = init.norm(d, one_plus=True)
        head[f"{p}.eh_proj.weight"] = init.linear(d, 2 * d)
        head[f"{p}.shared_head.output.weight"] = init.linear(c["vocab_size"], d, gain=4.0)
    return main, head


# -- exaone_moe --------------------------------------------------------------------------
def _exaone_layer(init: Init, p: str, c: dict, moe: bool) -> dict[str, mx.array]:
    d, hd = c["hidden_size"], c["head_dim"]
    a = f"{p}.self_attn"
    w = _attn(init, a, d, c["num_attention_heads"], c["num_key_value_heads"], hd, hd)
    w[f"{a}.q_norm.weight"] = init.norm(hd, one_plus=False)
    w[f"{a}.k_norm.weight"] = init.norm(hd, one_plus=False)
    w[f"{p}.input_layernorm.weight"] = init.norm(d, one_plus=False)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(d, one_plus=False)
    if not moe:
        w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
        return w
    n, inter = c["num_experts"], c["moe_intermediate_size"]
    w[f"{p}.mlp.gate.weight"] = init.linear(n, d)
    w[f"{p}.mlp.e_score_correction_bias"] = init.normal((n,), 0.1)
    w.update(_experts(init, f"{p}.mlp", d, n, inter))
    w.update(mlp(init, f"{p}.mlp.shared_experts", d, inter * c["num_shared_experts"]))
    return w


def _exaone_moe_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d = c["hidden_size"]
    main, _ = _main_and_head(init, c, "model.embed_tokens.weight")
    for i in range(c["num_hidden_layers"]):
        main.update(_exaone_layer(init, f"model.layers.{i}", c, c["is_moe_layer"][i]))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    head = {
        "mtp.fc.weight": init.linear(d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": init.norm(d, one_plus=False),
        "mtp.pre_fc_norm_hidden.weight": init.norm(d, one_plus=False),
        "mtp.norm.weight": init.norm(d, one_plus=False),
    }
    for j in range(c["num_nextn_predict_layers"]):
        head.update(_exaone_layer(init, f"mtp.layers.{j}", c, moe=False))
    return main, head


BUILDERS = {
    "mimo_v2_flash": _mimo_v2_flash_weights,
    "step3p5": _step3p5_weights,
    "exaone_moe": _exaone_moe_weights,
}
