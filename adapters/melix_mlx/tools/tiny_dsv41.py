"""A tiny DeepSeek-V4.1 checkpoint in its published layout, DSpark drafter included.

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under
  the published names (DeepSeek's own, no ``model.`` prefix: ``embed``, ``head``,
  ``norm``, ``layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}``, the
  compressor / indexer of the layers that have them, ``ffn.gate.{weight,bias}``,
  ``ffn.experts.{e}.w{1,2,3}``, ``ffn.shared_experts.w{1,2,3}``, ``attn_norm``,
  ``ffn_norm``, ``hc_{attn,ffn}_{fn,base,scale}``) that mlx-lm's ``sanitize`` renames.
  Weights are stored unquantized (the released fp8 / fp4 ``.scale`` pairs are mlx-lm's
  repack, not ours).
- The config is flat, with the keys mlx-lm reads plus the drafter's:
  ``num_nextn_predict_layers`` (3 stages), ``dspark_block_size``,
  ``dspark_noise_token_id``, ``dspark_target_layer_ids``, ``dspark_markov_rank``,
  ``dspark_n_routed_experts``, ``dspark_num_experts_per_tok``. ``compress_ratios`` has
  one entry per layer, the stages' zeros included (a stage attends over a window only).
- The drafter is ``mtp.{s}.*``: each stage a decoder block of the trunk's layout (its own
  MoE sized by the ``dspark_*`` expert keys), ``mtp.0.main_{proj,norm}`` on the first
  stage, ``norm``, ``markov_head.{embed,head}`` and ``confidence_head.proj`` on the last.
- The window is 4 positions and the compressors fold every 4 (ratio-1 layer too), so a
  few dozen tokens cross both many times.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .tiny_layers import Init, lm_head
from .tiny_tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

FAMILIES = ("deepseek_v41",)
HEAD_COUNT_KEY = {"deepseek_v41": "num_nextn_predict_layers"}
WINDOW = 4

CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v41": {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "head_dim": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "sliding_window": WINDOW,
        "compress_ratios": [0, 4, 4, 1, 0, 0, 0],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 2],
        "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 3,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "max_position_embeddings": 512,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "hc_eps": 1e-6,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 100,
        "dspark_target_layer_ids": [1, 2, 3],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 2,
        "dspark_num_experts_per_tok": 1,
    }
}


def _hc(init: Init, p: str, c: dict) -> dict[str, mx.array]:
    n, d = c["hc_mult"], c["hidden_size"]
    mix = (2 + n) * n
    out = {}
    for part in ("attn", "ffn"):
        out[f"{p}.hc_{part}_fn"] = init.normal((mix, n * d), 0.5 / (n * d) ** 0.5).astype(mx.float32)
        out[f"{p}.hc_{part}_base"] = init.normal((mix,), 0.5).astype(mx.float32)
        out[f"{p}.hc_{part}_scale"] = (1.0 + init.normal((3,), 0.1)).astype(mx.float32)
    return out


def _attn(init: Init, p: str, c: dict, layer: int) -> dict[str, mx.array]:
    d, h, hd, q = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    g, r = c["o_groups"], c["o_lora_rank"]
    w = {
        f"{p}.wq_a.weight": init.linear(q, d),
        f"{p}.q_norm.weight": init.norm(q, one_plus=False),
        f"{p}.wq_b.weight": init.linear(h * hd, q),
        f"{p}.wkv.weight": init.linear(hd, d),
        f"{p}.kv_norm.weight": init.norm(hd, one_plus=False),
        f"{p}.wo_a.weight": init.linear(g * r, h * hd // g),  # block diagonal, groups stacked
        f"{p}.wo_b.weight": init.linear(d, g * r),
        f"{p}.attn_sink": init.normal((h,), 0.5).astype(mx.float32),
    }
    ratios = c["compress_ratios"]
    ratio = ratios[layer] if layer < c["num_hidden_layers"] else 0
    if ratio and layer in c["kv_source_layer_ids"]:
        w[f"{p}.compressor.wkv.weight"] = init.linear(hd, d)
        if ratio > 1:
            w[f"{p}.compressor.wgate.weight"] = init.linear(hd, d)
        w[f"{p}.compressor.norm.weight"] = init.norm(hd, one_plus=False)
    if ratio and layer in c["index_source_layer_ids"]:
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        w[f"{p}.indexer.wq_b.weight"] = init.linear(ih * idim, q)
        w[f"{p}.indexer.weights_proj.weight"] = init.linear(ih, d)
        if layer in c["kv_source_layer_ids"]:
            w[f"{p}.indexer.wk.weight"] = init.linear(idim, hd)
            w[f"{p}.indexer.k_norm.weight"] = init.norm(idim, one_plus=False)
    return w


def _ffn(init: Init, p: str, c: dict, experts: int) -> dict[str, mx.array]:
    d, inter = c["hidden_size"], c["moe_intermediate_size"]
    w = {
        f"{p}.gate.weight": init.linear(experts, d).astype(mx.float32),
        f"{p}.gate.bias": init.normal((experts,), 0.1).astype(mx.float32),
    }
    for name in [f"experts.{e}" for e in range(experts)] + ["shared_experts"]:
        w[f"{p}.{name}.w1.weight"] = init.linear(inter, d)
        w[f"{p}.{name}.w3.weight"] = init.linear(inter, d)
        w[f"{p}.{name}.w2.weight"] = init.linear(d, inter)
    return w


def _block(init: Init, p: str, c: dict, layer: int, experts: int) -> dict[str, mx.array]:
    d = c["hidden_size"]
    return {
        **_attn(init, f"{p}.attn", c, layer),
        **_ffn(init, f"{p}.ffn", c, experts),
        f"{p}.attn_norm.weight": init.norm(d, one_plus=False),
        f"{p}.ffn_norm.weight": init.norm(d, one_plus=False),
        **_hc(init, p, c),
    }


def _weights(init: Init, c: dict) -> tuple[dict, dict]:
    d, vocab, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    embed = init.normal((vocab, d), 1.0)
    main = {"embed.weight": embed, "norm.weight": init.norm(d, one_plus=False)}
    main["head.weight"] = lm_head(init, vocab, d, embed)
    for i in range(n):
        main.update(_block(init, f"layers.{i}", c, i, c["n_routed_experts"]))
    stages, rank = c["num_nextn_predict_layers"], c["dspark_markov_rank"]
    experts = c.get("dspark_n_routed_experts") or c["n_routed_experts"]
    head: dict[str, mx.array] = {}
    for s in range(stages):
        head.update(_block(init, f"mtp.{s}", c, n + s, experts))
    taps = len(c["dspark_target_layer_ids"])
    head["mtp.0.main_proj.weight"] = init.linear(d, taps * d)
    head["mtp.0.main_norm.weight"] = init.norm(d, one_plus=False)
    last = f"mtp.{stages - 1}"
    head[f"{last}.norm.weight"] = init.norm(d, one_plus=False)
    head[f"{last}.markov_head.embed.weight"] = init.normal((vocab, rank), 1.0)
    head[f"{last}.markov_head.head.weight"] = init.linear(vocab, rank)
    head[f"{last}.confidence_head.proj.weight"] = init.linear(1, d + rank)
    return main, head


BUILDERS = {"deepseek_v41": _weights}
