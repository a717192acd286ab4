"""Tiny random-weight checkpoints in each family's real Hugging Face layout.

Rules:
- ``make_tiny(family, out_dir)`` writes ``config.json`` (the family's real keys),
  ``model.safetensors`` (main AND MTP-head tensors under their upstream HF names, in HF
  conventions: Qwen3.5 (1+w) norms stored as w, conv1d as [C, 1, K], DeepSeek experts
  unstacked and ``kv_b_proj`` unsplit) and the shared byte-level tokenizer.
- ``head_in_sidecar=True`` moves the head tensors to ``mtp.safetensors`` (the layout of
  some official Qwen3.5 releases; mlx-lm's ``model*.safetensors`` glob never reads it).
- Weights are seeded and deterministic. Scales are chosen so greedy decoding wanders over
  many tokens rather than repeating one; special tokens get zero lm_head rows so greedy
  runs rarely stop early on EOS.
- DeepSeek-V3 (3 main layers here) keeps its head at ``model.layers.{num_hidden_layers}``
  but, by default, in ``mtp.safetensors``: mlx-lm's deepseek_v3 ``sanitize`` drops only
  ``model.layers.61.*`` (hard-coded), so with any other depth a head inside
  ``model*.safetensors`` makes ``mlx_lm.load`` fail (strict load: unknown parameters).
  ``head_in_sidecar=None`` (default) therefore means "sidecar only for deepseek_v3 with
  num_hidden_layers != 61"; pass ``False`` to reproduce that upstream failure.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import (
    tiny_dsa,
    tiny_dsv41,
    tiny_ernie_longcat,
    tiny_linear,
    tiny_longcat_ngram,
    tiny_moe,
    tiny_nemotron,
    tiny_swa,
)
from .tiny_layers import Init, lm_head, mlp, qwen3_5_full_attn, qwen3_5_linear_attn
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, write_tokenizer

_BASE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_5": {
        "model_type": "qwen3_5_text",
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
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "mamba_ssm_dtype": "float32",
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
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 64,
        "q_lora_rank": 64,
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
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    },
    "mimo": {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "max_window_layers": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 640000,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    },
}

FAMILIES = tuple(_BASE_CONFIGS)  # the core families every decode test runs over
# families whose fixtures live in melix_mlx.tools.tiny_moe (their own tests: test_families*.py)
MORE_FAMILIES = ("glm4_moe", "glm4_moe_lite", "qwen3_5_moe", "qwen3_next")
ALL_FAMILIES = FAMILIES + MORE_FAMILIES + tiny_dsa.FAMILIES + tiny_ernie_longcat.FAMILIES
ALL_FAMILIES += tiny_linear.FAMILIES
ALL_FAMILIES += tiny_nemotron.FAMILIES
ALL_FAMILIES += tiny_swa.FAMILIES
ALL_FAMILIES += tiny_dsv41.FAMILIES
ALL_FAMILIES += tiny_longcat_ngram.FAMILIES
# the config key each family's head count is written under (``mtp_layers``)
HEAD_COUNT_KEY = {
    "qwen3_5": "mtp_num_hidden_layers",
    "qwen3_5_moe": "mtp_num_hidden_layers",
    "qwen3_next": "mtp_num_hidden_layers",
    "deepseek_v3": "num_nextn_predict_layers",
    "glm4_moe": "num_nextn_predict_layers",
    "glm4_moe_lite": "num_nextn_predict_layers",
    "mimo": "num_nextn_predict_layers",
}
HEAD_COUNT_KEY.update(tiny_dsa.HEAD_COUNT_KEY)
HEAD_COUNT_KEY.update(tiny_linear.HEAD_COUNT_KEY)
HEAD_COUNT_KEY.update(tiny_ernie_longcat.HEAD_COUNT_KEY)
HEAD_COUNT_KEY.update(tiny_nemotron.HEAD_COUNT_KEY)
HEAD_COUNT_KEY.update(tiny_swa.HEAD_COUNT_KEY)
HEAD_COUNT_KEY.update(tiny_dsv41.HEAD_COUNT_KEY)
HEAD_COUNT_KEY.update(tiny_longcat_ngram.HEAD_COUNT_KEY)


def tiny_config(family: str, overrides: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """Return (config.json dict, the language-model settings dict inside it)."""
    if family in tiny_nemotron.CONFIGS:  # flat config
        text = copy.deepcopy(tiny_nemotron.CONFIGS[family])
        text.update(overrides)
        return text, text
    if family in tiny_swa.CONFIGS:  # flat configs
        text = copy.deepcopy(tiny_swa.CONFIGS[family])
        text.update(overrides)
        tiny_swa.fit_layers(family, text)
        return text, text
    if family in tiny_dsv41.CONFIGS:  # flat config
        text = copy.deepcopy(tiny_dsv41.CONFIGS[family])
        text.update(overrides)
        return text, text
    if family in tiny_linear.CONFIGS:  # flat configs
        text = copy.deepcopy(tiny_linear.CONFIGS[family])
        text.update(overrides)
        return text, text
    if family in tiny_longcat_ngram.CONFIGS:  # flat config
        text = copy.deepcopy(tiny_longcat_ngram.CONFIGS[family])
        text.update(overrides)
        return text, text
    if family in tiny_dsa.CONFIGS or family in tiny_ernie_longcat.CONFIGS:  # flat configs
        text = copy.deepcopy({**tiny_dsa.CONFIGS, **tiny_ernie_longcat.CONFIGS}[family])
        text.update(overrides)
        return text, text
    if family in MORE_FAMILIES:
        text = copy.deepcopy(tiny_moe.CONFIGS[family])
        text.update(overrides)
        return tiny_moe.wrap_config(family, text), text
    if family not in _BASE_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {ALL_FAMILIES}")
    text = copy.deepcopy(_BASE_CONFIGS[family])
    text.update(overrides)
    if family != "qwen3_5":
        return text, text
    n, every = text["num_hidden_layers"], text["full_attention_interval"]
    text["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "language_model_only": True,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }
    return config, text


def _qwen3_5_layer(init: Init, p: str, c: dict, full: bool) -> dict[str, mx.array]:
    d = c["hidden_size"]
    w = (
        qwen3_5_full_attn(init, f"{p}.self_attn", c)
        if full
        else qwen3_5_linear_attn(init, f"{p}.linear_attn", c)
    )
    w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
    w[f"{p}.input_layernorm.weight"] = init.norm(d, one_plus=True)
    w[f"{p}.post_attention_layernorm.weight"] = init.norm(d, one_plus=True)
    return w


def _qwen3_5_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v = c["hidden_size"], c["vocab_size"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"model.language_model.embed_tokens.weight": embed}
    for i in range(c["num_hidden_layers"]):
        full = (i + 1) % c["full_attention_interval"] == 0
        main.update(_qwen3_5_layer(init, f"model.language_model.layers.{i}", c, full))
    main["model.language_model.norm.weight"] = init.norm(d, one_plus=True)
    if not c["tie_word_embeddings"]:
        main["lm_head.weight"] = lm_head(init, v, d, embed)
    head = {
        "mtp.fc.weight": init.linear(d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": init.norm(d, one_plus=True),
        "mtp.pre_fc_norm_hidden.weight": init.norm(d, one_plus=True),
        "mtp.norm.weight": init.norm(d, one_plus=True),
    }
    for j in range(c["mtp_num_hidden_layers"]):
        head.update(_qwen3_5_layer(init, f"mtp.layers.{j}", c, full=True))
    return main, head


def _qwen2_layer(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = d // h
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
    w.update(mlp(init, f"{p}.mlp", d, c["intermediate_size"]))
    return w


def _mimo_weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, v = c["hidden_size"], c["vocab_size"]
    embed = init.normal((v, d), 1.0)
    main: dict[str, mx.array] = {"model.embed_tokens.weight": embed}
    for i in range(c["num_hidden_layers"]):
        main.update(_qwen2_layer(init, f"model.layers.{i}", c))
    main["model.norm.weight"] = init.norm(d, one_plus=False)
    if not c["tie_word_embeddings"]:
        main["lm_head.weight"] = lm_head(init, v, d, embed)
    head: dict[str, mx.array] = {}
    for j in range(c["num_nextn_predict_layers"]):
        p = f"model.mtp_layers.{j}"
        head.update(_qwen2_layer(init, p, c))
        head[f"{p}.token_layernorm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.hidden_layernorm.weight"] = init.norm(d, one_plus=False)
        head[f"{p}.input_proj.weight"] = init.linear(d, 2 * d)
        head[f"{p}.final_layernorm.weight"] = init.norm(d, one_plus=False)
    return main, head


_BUILDERS = {"qwen3_5": _qwen3_5_weights, "mimo": _mimo_weights}


def _builder(family: str) -> Any:
    if family in tiny_nemotron.BUILDERS:
        return tiny_nemotron.BUILDERS[family]
    if family in tiny_swa.BUILDERS:
        return tiny_swa.BUILDERS[family]
    if family in tiny_dsv41.BUILDERS:
        return tiny_dsv41.BUILDERS[family]
    if family in tiny_linear.BUILDERS:
        return tiny_linear.BUILDERS[family]
    if family in tiny_dsa.BUILDERS:
        return tiny_dsa.BUILDERS[family]
    if family in tiny_ernie_longcat.BUILDERS:
        return tiny_ernie_longcat.BUILDERS[family]
    if family in tiny_longcat_ngram.BUILDERS:
        return tiny_longcat_ngram.BUILDERS[family]
    if family not in _BUILDERS:  # the MoE layouts (DeepSeek-V3 included) live in tiny_moe
        return tiny_moe.BUILDERS[family]
    return _BUILDERS[family]


def make_tiny(
    family: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    head_in_sidecar: bool | None = None,
    dtype: str = "float32",
    mtp_layers: int | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of ``family`` into ``out_dir`` and return the path.

    ``overrides`` replace language-model config keys (``text_config`` for qwen3_5), e.g.
    ``hidden_size=32`` or ``num_hidden_layers=2``. ``mtp_layers`` sets the head count
    (written under the family's own key; every layer gets its own tensors).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if mtp_layers is not None:
        if mtp_layers < 1:
            raise ValueError(f"mtp_layers must be >= 1, got {mtp_layers}")
        overrides[HEAD_COUNT_KEY[family]] = mtp_layers
    config, text = tiny_config(family, overrides)
    text_dtype_key = "dtype" if "text_config" in config else "torch_dtype"
    text[text_dtype_key] = dtype
    if head_in_sidecar is None:
        head_in_sidecar = family == "deepseek_v3" and text["num_hidden_layers"] != 61
    init = Init(seed, getattr(mx, dtype))
    main, head = _builder(family)(init, text)

    meta = {"format": "pt"}
    if head_in_sidecar:
        mx.save_safetensors(str(out / "model.safetensors"), main, metadata=meta)
        mx.save_safetensors(str(out / "mtp.safetensors"), head, metadata=meta)
    else:
        mx.save_safetensors(str(out / "model.safetensors"), {**main, **head}, metadata=meta)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out)
    return out
