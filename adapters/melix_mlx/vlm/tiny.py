"""A tiny Qwen3.5 vision-language checkpoint in the Hugging Face layout, for CPU tests.

Rules:
- ``write_tiny_vl(out)`` copies the embedded ``stdlib-hybrid`` (its trained text weights and
  MTP head, unchanged) and wraps it as a Qwen3.5 VL checkpoint: a ``vision_config`` for a
  one-block vision tower whose output width is the text hidden size, its tensors under
  ``model.visual.*`` in the upstream layout (the patch embedding in PyTorch's NCDHW
  order), the image / video / vision-start / vision-end token ids, and an image
  processor config. mlx-vlm loads it like a real checkpoint.
- The byte-level tokenizer has no room for new ids (vocabulary 1024), so the four last
  merges are dropped and the four vision tokens take their ids as added special tokens
  (``VISION_TOKENS``); text those merges made now encodes as their parts.
- The vision tower's weights are random (seeded): the tests check identity against
  mlx-vlm on the same weights, not what the tower sees.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..loading.checkpoints import EMBEDDED

VISION_TOKENS = {
    "<|video_pad|>": 1020,
    "<|image_pad|>": 1021,
    "<|vision_start|>": 1022,
    "<|vision_end|>": 1023,
}
PATCH = 16  # pixels per patch side; a 32 x 32 image is 2 x 2 patches, merged into one token
VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": PATCH,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [],
    "hidden_act": "gelu_pytorch_tanh",
}


def _vision_weights(vision_cfg: dict, seed: int) -> dict[str, mx.array]:
    from mlx_vlm.models.qwen3_5.config import VisionConfig
    from mlx_vlm.models.qwen3_5.vision import VisionModel

    mx.random.seed(seed)
    tower = VisionModel(VisionConfig.from_dict(vision_cfg))
    out = {}
    for key, value in tree_flatten(tower.parameters()):
        if key == "patch_embed.proj.weight":
            value = value.transpose(0, 4, 1, 2, 3)  # MLX NDHWC -> upstream NCDHW
        out[f"model.visual.{key}"] = value
    return out


def _free_ids(bpe: dict, ids: set[int]) -> None:
    """Drop the BPE entries holding ``ids`` and the merges that made them."""
    dropped = {t for t, i in bpe["vocab"].items() if i in ids}
    bpe["vocab"] = {t: i for t, i in bpe["vocab"].items() if i not in ids}

    def made(merge: str | list[str]) -> str:
        return "".join(merge.split(" ", 1) if isinstance(merge, str) else merge)

    bpe["merges"] = [m for m in bpe["merges"] if made(m) not in dropped]


def write_tiny_vl(out: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny VL checkpoint into ``out`` (created); returns it."""
    src, out = EMBEDDED["stdlib-hybrid"], Path(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("training_report.json"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("language_model_only", None)
    vision = {**VISION, "out_hidden_size": cfg["text_config"]["hidden_size"], "model_type": "qwen3_5"}
    cfg.update(
        vision_config=vision,
        image_token_id=VISION_TOKENS["<|image_pad|>"],
        video_token_id=VISION_TOKENS["<|video_pad|>"],
        vision_start_token_id=VISION_TOKENS["<|vision_start|>"],
        vision_end_token_id=VISION_TOKENS["<|vision_end|>"],
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = dict(mx.load(str(src / "model.safetensors")))
    tensors.update(_vision_weights(vision, seed))
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model.safetensors" for k in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    tok = json.loads((out / "tokenizer.json").read_text())
    _free_ids(tok["model"], set(VISION_TOKENS.values()))
    for content, i in VISION_TOKENS.items():
        tok["added_tokens"].append(
            {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
        )
    (out / "tokenizer.json").write_text(json.dumps(tok))
    pre = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 32 * 32,
        "max_pixels": 64 * 64,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return out
