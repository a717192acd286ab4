"""Tiny checkpoints outside the MTP families, for the compatibility tests.

Rules:
- `make_llama(out)`: a random 2-layer llama (no MTP head) in mlx-lm's layout with the
  embedded checkpoints' tokenizer, so it shares their vocabulary (a draft model or a
  plain-decode target). Extra keyword arguments go into its config.json (e.g.
  `layer_types` / `sliding_window`, which mlx-lm's llama reads to window layers).
- `make_sidecar(src, out)`: a copy of `src` whose config marks it as an MTP-only
  sidecar (architecture name with "MTP"), which the registry refuses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

TOKENIZER_FROM = Path(__file__).resolve().parents[2] / "adapters" / "melix_mlx" / "assets" / "stdlib-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_llama(out: Path, seed: int = 0, hidden_size: int = 64, **extra: object) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": 2,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        **extra,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_FROM / name, out / name)
    return out


def make_sidecar(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["DeepseekV3MTPForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    return out
