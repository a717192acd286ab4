"""Fake checkpoints for the registry and receipt tests: config.json + hand-written safetensors.

Rules of this file:
- No mlx: a safetensors file is an 8-byte little-endian header length, the JSON header and
  zero bytes for the data. Every tensor is F32 [1] (4 bytes) unless stated otherwise.
- `FAMILY_KEYS[family]` gives (config, main keys, head keys) in the family's real HF names;
  `Fakes.make(...)` writes them single-file, sharded (with an index) or with the head in a
  separate mtp.safetensors.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import pytest


def write_safetensors(path: Path, keys: list[str], metadata: dict[str, str] | None = None) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for key in keys:
        header[key] = {"dtype": "F32", "shape": [1], "data_offsets": [offset, offset + 4]}
        offset += 4
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def write_tokenizer(path: Path, vocab: dict[str, int] | None = None) -> None:
    vocab = vocab if vocab is not None else {chr(97 + i): i for i in range(26)}
    doc = {
        "version": "1.0",
        "added_tokens": [{"id": len(vocab), "content": "<eos>", "special": True}],
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }
    (path / "tokenizer.json").write_text(json.dumps(doc))


_QWEN_HEAD = [
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.mlp.gate_proj.weight",
]


def _ds_head(n: int) -> list[str]:
    p = f"model.layers.{n}."
    return [
        p + "enorm.weight",
        p + "hnorm.weight",
        p + "eh_proj.weight",
        p + "shared_head.norm.weight",
        p + "shared_head.head.weight",
        p + "self_attn.kv_a_proj_with_mqa.weight",
        p + "mlp.experts.0.gate_proj.weight",
    ]


_MIMO_HEAD = [
    "model.mtp_layers.0.token_layernorm.weight",
    "model.mtp_layers.0.hidden_layernorm.weight",
    "model.mtp_layers.0.input_proj.weight",
    "model.mtp_layers.0.final_layernorm.weight",
    "model.mtp_layers.0.self_attn.q_proj.weight",
]

_PLAIN_MAIN = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
_QWEN_MAIN = [
    "model.language_model.embed_tokens.weight",
    "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight",
    "model.language_model.layers.1.self_attn.q_proj.weight",
    "lm_head.weight",
]


def _qwen3_5_config(model_type: str = "qwen3_5") -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": model_type,
        "text_config": {
            "model_type": f"{model_type}_text",
            "num_hidden_layers": 2,
            "mtp_num_hidden_layers": 1,
            "vocab_size": 27,
            "layer_types": ["linear_attention", "full_attention"],
        },
    }


# family -> (config.json, main keys, head keys)
FAMILY_KEYS: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {
    "qwen3_5": (_qwen3_5_config(), _QWEN_MAIN, _QWEN_HEAD),
    "qwen3_5_moe": (_qwen3_5_config("qwen3_5_moe"), _QWEN_MAIN, _QWEN_HEAD),
    "qwen3_next": (
        {"model_type": "qwen3_next", "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "vocab_size": 27},
        _PLAIN_MAIN,
        _QWEN_HEAD,
    ),
    "deepseek_v3": (
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 3,
            "num_nextn_predict_layers": 1,
            "vocab_size": 27,
        },
        _PLAIN_MAIN,
        _ds_head(3),
    ),
    "glm4_moe": (
        {"model_type": "glm4_moe", "num_hidden_layers": 3, "num_nextn_predict_layers": 1, "vocab_size": 27},
        _PLAIN_MAIN,
        _ds_head(3),
    ),
    "mimo": (
        {"model_type": "mimo", "num_hidden_layers": 3, "num_nextn_predict_layers": 1, "vocab_size": 27},
        _PLAIN_MAIN,
        _MIMO_HEAD,
    ),
    "llama": ({"model_type": "llama", "num_hidden_layers": 1, "vocab_size": 27}, _PLAIN_MAIN, []),
}


class Fakes:
    """Builds fake checkpoint directories under one tmp_path."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0

    def dir(self, name: str | None = None) -> Path:
        self.count += 1
        path = self.root / (name or f"ckpt{self.count}")
        path.mkdir(parents=True)
        return path

    def make(
        self,
        family: str = "qwen3_5",
        *,
        layout: str = "single",  # single | sharded | sidecar (head in mtp.safetensors)
        head: bool = True,
        config: dict[str, Any] | None = None,
        update: dict[str, Any] | None = None,
        tokenizer: bool = True,
        name: str | None = None,
    ) -> Path:
        base_config, main, head_keys = FAMILY_KEYS[family]
        cfg = copy.deepcopy(config if config is not None else base_config)
        cfg.update(update or {})
        head_keys = head_keys if head else []
        path = self.dir(name)
        (path / "config.json").write_text(json.dumps(cfg))
        if layout == "single":
            write_safetensors(path / "model.safetensors", main + head_keys, {"format": "pt"})
        elif layout == "sharded":
            shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": head_keys}
            weight_map = {}
            for shard, keys in shards.items():
                write_safetensors(path / shard, keys)
                weight_map.update({k: shard for k in keys})
            index = {"metadata": {"total_size": 4}, "weight_map": weight_map}
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
        elif layout == "sidecar":
            write_safetensors(path / "model.safetensors", main)
            if head_keys:
                write_safetensors(path / "mtp.safetensors", head_keys)
        else:
            raise ValueError(layout)
        if tokenizer:
            write_tokenizer(path)
        return path


@pytest.fixture
def fakes(tmp_path: Path) -> Fakes:
    return Fakes(tmp_path)
