"""The DeepSeek-V3 layout (``stdlib-tiny``): config.json, the training-time MTP head, and the
Hugging Face names the checkpoint is saved under.

The main model is ``mlx_lm.models.deepseek_v3.Model`` itself, so the trained forward is the
one inference runs. The head follows DeepSeek-V3: ``x = eh_proj(cat[enorm(embed(t_{i+1})),
hnorm(h_i)])`` (embedding first), one decoder layer (MLA; dense by default, MoE with
``--moe-head``), ``logits = shared_head.head(shared_head.norm(x))``, sharing the main
``embed_tokens`` and ``lm_head``. Saved weights use Hugging Face names (the inverse of
mlx-lm's ``sanitize``: ``kv_b_proj`` re-joined from ``embed_q``/``unembed_out``, experts
unstacked); copies of the shared tensors are stored under the head, as the public
DeepSeek-V3 checkpoint does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3 as dsv3
from mlx_lm.models.base import create_attention_mask


def model_config(
    vocab_size: int,
    eos_id: int,
    *,
    layers: int = 8,
    hidden: int = 192,
    intermediate: int = 512,
    heads: int = 4,
    moe_head: bool = False,
    moe_intermediate: int | None = None,
    mtp: bool = True,
) -> dict[str, Any]:
    """The checkpoint's config.json. Main layers are dense. The MTP layer (index ``layers``)
    is dense by default (``first_k_dense_replace = layers + 1 > num_hidden_layers``, a valid
    DeepSeek-V3 config); ``moe_head`` makes it MoE (``first_k_dense_replace = layers``).
    ``mtp=False`` (a draft model) advertises no MTP layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate or hidden,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1 if mtp else 0,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        # q_lora_rank null -> plain q_proj (as DeepSeek-V2-Lite); MLA KV compression kept.
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        # MoE only where the layer index >= first_k_dense_replace: the MTP layer, or none.
        "first_k_dense_replace": layers if moe_head else layers + 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


# --------------------------------------------------------------------------------------
# Training-time MTP head (DeepSeek-V3 layout)
# --------------------------------------------------------------------------------------


class SharedHeadNorm(nn.Module):
    """``shared_head``: its ``norm`` is the head's own; ``head`` is the main lm_head."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dims, eps=eps)


class MTPHead(dsv3.DeepseekV3DecoderLayer):
    """One DeepSeek-V3 MTP module. Subclassing the decoder layer keeps its parameter names
    (``self_attn.*``, ``mlp.*``, ``input_layernorm``...) exactly those of a main layer."""

    def __init__(self, args: dsv3.ModelArgs) -> None:
        super().__init__(args, layer_idx=args.num_hidden_layers)
        dims = args.hidden_size
        self.enorm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * dims, dims, bias=False)
        self.shared_head = SharedHeadNorm(dims, args.rms_norm_eps)

    def hidden(
        self, h: mx.array, tok_emb: mx.array, cache: Any = None, mask: mx.array | None = None
    ) -> mx.array:
        """Pre-norm output of the head for pairs (h_i, embed(t_{i+1}))."""
        x = self.eh_proj(mx.concatenate([self.enorm(tok_emb), self.hnorm(h)], axis=-1))
        if mask is None:
            mask = create_attention_mask(x, cache, return_array=True)
        return dsv3.DeepseekV3DecoderLayer.__call__(self, x, mask, cache)


def head_logits(head: MTPHead, main: dsv3.Model, x: mx.array) -> mx.array:
    return main.lm_head(head.shared_head.norm(x))


def layer_to_hf(params: dict[str, mx.array], prefix: str, args: dsv3.ModelArgs) -> dict:
    """Inverse of deepseek_v3 sanitize for one layer's flat mlx params (names relative to
    the layer) -> HF names under ``prefix``."""
    out: dict[str, mx.array] = {}
    wk = params.get("self_attn.embed_q.weight")  # (heads, kv_lora, nope)
    wv = params.get("self_attn.unembed_out.weight")  # (heads, v_dim, kv_lora)
    for name, value in params.items():
        if name in ("self_attn.embed_q.weight", "self_attn.unembed_out.weight"):
            continue
        if name.startswith("mlp.switch_mlp."):
            proj = name.split(".")[2]  # gate_proj / up_proj / down_proj
            for e in range(value.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{proj}.weight"] = value[e]
            continue
        out[f"{prefix}.{name}"] = value
    if wk is not None and wv is not None:
        # HF kv_b_proj rows are per head [nope rows for K, v_dim rows for V].
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        out[f"{prefix}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, args.kv_lora_rank)
    return out


def layer_from_hf(weights: dict[str, mx.array], prefix: str, args: dsv3.ModelArgs) -> dict:
    """HF names under ``prefix`` -> flat mlx names relative to the layer (what sanitize does,
    applied to the MTP layer; used here only to verify the saved head round-trips)."""
    rel = {k[len(prefix) + 1 :]: v for k, v in weights.items() if k.startswith(prefix + ".")}
    out: dict[str, mx.array] = {}
    experts: dict[str, dict[int, mx.array]] = {}
    for name, value in rel.items():
        parts = name.split(".")
        if name.startswith("mlp.experts."):
            experts.setdefault(parts[3], {})[int(parts[2])] = value
        elif name == "self_attn.kv_b_proj.weight":
            nope = args.qk_nope_head_dim
            v = value.reshape(args.num_attention_heads, nope + args.v_head_dim, -1)
            out["self_attn.embed_q.weight"] = mx.contiguous(v[:, :nope, :].swapaxes(-1, -2))
            out["self_attn.unembed_out.weight"] = mx.contiguous(v[:, nope:, :])
        else:
            out[name] = value
    for proj, per_expert in experts.items():
        out[f"mlp.switch_mlp.{proj}.weight"] = mx.stack(
            [per_expert[e] for e in sorted(per_expert)]
        )
    return out


def main_to_hf(model: dsv3.Model) -> dict[str, mx.array]:
    flat = dict(tree_flatten(model.parameters()))
    out: dict[str, mx.array] = {}
    for i in range(model.args.num_hidden_layers):
        pre = f"model.layers.{i}."
        layer = {k[len(pre) :]: v for k, v in flat.items() if k.startswith(pre)}
        out.update(layer_to_hf(layer, pre[:-1], model.args))
    out.update({k: v for k, v in flat.items() if not k.startswith("model.layers.")})
    return out


def head_to_hf(head: MTPHead, main: dsv3.Model) -> dict[str, mx.array]:
    prefix = f"model.layers.{main.args.num_hidden_layers}"
    out = layer_to_hf(dict(tree_flatten(head.parameters())), prefix, main.args)
    # Shared tensors, stored again under the head as in deepseek-ai/DeepSeek-V3.
    out[f"{prefix}.embed_tokens.weight"] = main.model.embed_tokens.weight
    out[f"{prefix}.shared_head.head.weight"] = main.lm_head.weight
    return out
