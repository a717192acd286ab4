"""Tiny checkpoints of the sparse-attention (DSA) families in their Hugging Face layout.

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under
  the upstream HF names and conventions, head tensors included, the shared tokenizer.
- deepseek_v32 (DeepSeek-V3.2): DeepSeek-V3's names (latent attention with an unsplit
  ``kv_b_proj``, per-expert MoE with ``e_score_correction_bias`` and shared experts) plus,
  in every attention, the lightning indexer ``self_attn.indexer.{wq_b, wk, k_norm
  (LayerNorm: weight and bias), weights_proj}``. Flat config with ``index_n_heads``,
  ``index_head_dim``, ``index_topk``; head at ``model.layers.{num_hidden_layers + j}``
  (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm, head}``, a copy of the
  embedding) inside ``model.safetensors``: mlx-lm's deepseek_v32 ``sanitize`` drops every
  layer index >= ``num_hidden_layers``, so its own loader reads the directory.
- glm_moe_dsa (GLM-5): the same tensors; the config carries ``rope_parameters`` (mlx-lm
  requires it and reads ``rope_theta`` from it) and ``indexer_rope_interleave``.
- ``index_topk`` is set below the tests' contexts, so the indexer really drops keys.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .tiny_layers import Init
from .tiny_moe import deepseek_weights
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

_SHARED: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
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
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 6,
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
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": EOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {
        **_SHARED,
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "rope_theta": 10000,
        "rope_scaling": None,
    },
    "glm_moe_dsa": {
        **_SHARED,
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "rms_norm_eps": 1e-5,
        "indexer_rope_interleave": True,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    },
}

FAMILIES = tuple(CONFIGS)
HEAD_COUNT_KEY = dict.fromkeys(FAMILIES, "num_nextn_predict_layers")


def _indexer(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    d, heads, dim = c["hidden_size"], c["index_n_heads"], c["index_head_dim"]
    k = f"{p}.self_attn.indexer"
    return {
        f"{k}.wq_b.weight": init.linear(heads * dim, c["q_lora_rank"]),
        f"{k}.wk.weight": init.linear(dim, d),
        f"{k}.k_norm.weight": init.norm(dim, one_plus=False),
        f"{k}.k_norm.bias": init.normal((dim,), 0.1),
        f"{k}.weights_proj.weight": init.linear(heads, d),
    }


def _dsa_weights(init: Init, c: dict) -> tuple[dict, dict]:
    main, head = deepseek_weights(init, c)
    n = c["num_hidden_layers"]
    for i in range(n):
        main.update(_indexer(init, f"model.layers.{i}", c))
    for j in range(c["num_nextn_predict_layers"]):
        head.update(_indexer(init, f"model.layers.{n + j}", c))
    return main, head


BUILDERS = dict.fromkeys(FAMILIES, _dsa_weights)
