"""The Qwen3.5 hybrid layout (``stdlib-hybrid``, ``--family qwen3_5``): config.json, the
training head, and the Hugging Face names the checkpoint is saved under.

``model_type`` ``qwen3_5`` with ``text_config``; GatedDeltaNet linear-attention layers and a
full-attention layer every ``--full-attention-interval``. The main model is
``mlx_lm.models.qwen3_5.Model`` itself and the head is the project's own
``melix_mlx.loading.heads.qwen3_5.MTPHead``, so both train with the forward inference runs. Saved
as ``model.language_model.*``, conv1d as ``[C, 1, K]``, every (1+w) RMSNorm stored as w, the
head under ``mtp.*`` inside ``model.safetensors``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5 as q35
from mlx_lm.models.base import create_attention_mask


def qwen3_5_config(
    vocab_size: int,
    eos_id: int,
    *,
    layers: int = 8,
    hidden: int = 192,
    intermediate: int = 512,
    heads: int = 4,
    full_attention_interval: int = 4,
    mtp: bool = True,
) -> dict[str, Any]:
    """A Qwen3.5 config.json (``text_config`` inside, as the released checkpoints): every
    ``full_attention_interval``-th layer is full (gated) attention, the others GatedDeltaNet
    linear attention; ``mtp_num_hidden_layers`` advertises the head."""
    head_dim = 32
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "full_attention_interval": full_attention_interval,
        "layer_types": [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": head_dim,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(1, heads // 2),
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "partial_rotary_factor": 0.25,
        # rotary dims = head_dim * 0.25 = 8 -> 4 frequencies, split t/h/w as released configs
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": "float32",
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "language_model_only": True,
        "tie_word_embeddings": False,
        "text_config": text,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


class _NormRef:
    """``head.shared_head.norm`` for the Qwen3.5 head (its final ``mtp.norm``), so the
    evaluation code below drives both families through one interface."""

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm


def qwen3_5_head(text: Any) -> Any:
    """The project's own Qwen3.5 head module (the inference forward), wired to ``text``'s
    embedding and lm_head, with the ``hidden`` / ``shared_head.norm`` interface of
    ``MTPHead`` above. Its parameters are the head's own only."""
    from melix_mlx.loading.heads.qwen3_5 import MTPHead as Qwen3_5Head

    class TrainHead(Qwen3_5Head):
        @property
        def shared_head(self) -> _NormRef:
            return _NormRef(self.norm)

        def hidden(
            self, h: mx.array, tok_emb: mx.array, cache: Any = None, mask: mx.array | None = None
        ) -> mx.array:
            """Pre-norm output for pairs (h_i, embed(t_{i+1})): ``__call__`` minus the norm."""
            e = self.pre_fc_norm_embedding(tok_emb)
            x = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(h)], axis=-1))
            if mask is None:
                mask = create_attention_mask(x, cache)
            return self.layers[0](x, mask=mask, cache=cache)

    return TrainHead(text.args, text.model.embed_tokens, text.lm_head)


# HF stores these Qwen3.5 norms as w with forward (1 + w); mlx-lm adds the 1 when it
# sanitizes an HF checkpoint (recognised by its [C, 1, K] conv1d weights).
_Q35_MAIN_ONE_PLUS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                      "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
_Q35_HEAD_ONE_PLUS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
                      ".input_layernorm.weight", ".post_attention_layernorm.weight",
                      ".q_norm.weight", ".k_norm.weight")


def qwen3_5_main_to_hf(model: q35.Model) -> dict[str, mx.array]:
    """Inverse of qwen3_5 ``sanitize``: HF names, conv1d as [C, 1, K], (1+w) norms as w."""
    out: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):
            key = "model.language_model." + name[len("language_model.model."):]
        else:
            key = name[len("language_model."):]  # lm_head.weight
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        elif value.ndim == 1 and name.endswith(_Q35_MAIN_ONE_PLUS):
            value = value - 1.0
        out[key] = value
    return out


def qwen3_5_head_to_hf(head: nn.Module) -> dict[str, mx.array]:
    """The head's own tensors under ``mtp.*``, (1+w) norms stored as w (inverse of the
    project's ``heads.qwen3_5.from_hf``)."""
    out: dict[str, mx.array] = {}
    for name, value in tree_flatten(head.parameters()):
        if value.ndim == 1 and name.endswith(_Q35_HEAD_ONE_PLUS) and "linear_attn" not in name:
            value = value - 1.0
        out[f"mtp.{name}"] = value
    return out
