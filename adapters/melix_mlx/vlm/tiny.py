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
- ``family="qwen3_5_moe"`` writes the Qwen3.5/3.6-MoE variant (the 35B-A3B layout): wrapper
  ``qwen3_5_moe``, ``text_config`` ``qwen3_5_moe_text`` with the MoE keys, and every
  feed-forward (the head's too) a sparse-MoE block stored as released: router
  ``mlp.gate``, fused ``mlp.experts.gate_up_proj`` [E, 2I, D] / ``mlp.experts.down_proj``
  [E, D, I], ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``. The trained dense
  feed-forward becomes the shared expert (its down projection doubled, the gate near zero:
  sigmoid ~ 1/2), the routed experts are small random ones (seeded) that move every
  layer's output by a few percent: routing changes the logits, and the trained head still
  drafts well (MTP acceptance, not only identity, is exercised).
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


MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}
FAMILIES = ("qwen3_5", "qwen3_5_moe")


def _as_moe(text: dict, tensors: dict[str, mx.array], seed: int) -> None:
    """Make the dense checkpoint's text config and tensors the MoE variant, in place."""
    dense = text.pop("intermediate_size")
    text.update(MOE, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=dense)
    n_exp, inter, d = MOE["num_experts"], MOE["moe_intermediate_size"], text["hidden_size"]
    prefixes = sorted({k.rsplit(".mlp.", 1)[0] for k in tensors if ".mlp.gate_proj." in k})
    for i, p in enumerate(prefixes):  # every layer's, and the head's
        k = mx.random.split(mx.random.key(seed * 10_000 + i + 1), 4)
        mlp = f"{p}.mlp"
        for proj in ("gate_proj", "up_proj"):
            tensors[f"{mlp}.shared_expert.{proj}.weight"] = tensors.pop(f"{mlp}.{proj}.weight")
        tensors[f"{mlp}.shared_expert.down_proj.weight"] = 2.0 * tensors.pop(f"{mlp}.down_proj.weight")
        # sigmoid(gate . x) stays near 1/2 (x is RMS-normed): the doubled shared expert ~ the dense MLP
        tensors[f"{mlp}.shared_expert_gate.weight"] = 0.01 * mx.random.normal((1, d), key=k[0])
        # a router of unit-scale logits, so the top-2 choice varies token to token
        tensors[f"{mlp}.gate.weight"] = mx.random.normal((n_exp, d), key=k[1]) / d**0.5
        tensors[f"{mlp}.experts.gate_up_proj"] = mx.random.normal((n_exp, 2 * inter, d), key=k[2]) / d**0.5
        tensors[f"{mlp}.experts.down_proj"] = 0.02 * mx.random.normal((n_exp, d, inter), key=k[3])


def _free_ids(bpe: dict, ids: set[int]) -> None:
    """Drop the BPE entries holding ``ids`` and the merges that made them."""
    dropped = {t for t, i in bpe["vocab"].items() if i in ids}
    bpe["vocab"] = {t: i for t, i in bpe["vocab"].items() if i not in ids}

    def made(merge: str | list[str]) -> str:
        return "".join(merge.split(" ", 1) if isinstance(merge, str) else merge)

    bpe["merges"] = [m for m in bpe["merges"] if made(m) not in dropped]


def write_tiny_vl(out: str | Path, *, seed: int = 0, family: str = "qwen3_5") -> Path:
    """Write the tiny VL checkpoint of ``family`` (``FAMILIES``) into ``out`` (created); returns it."""
    if family not in FAMILIES:
        raise ValueError(f"no tiny VL checkpoint of {family!r}; choose from {FAMILIES}")
    src, out = EMBEDDED["stdlib-hybrid"], Path(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("training_report.json"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("language_model_only", None)
    tensors = dict(mx.load(str(src / "model.safetensors")))
    if family == "qwen3_5_moe":
        _as_moe(cfg["text_config"], tensors, seed)
        cfg.update(model_type=family, architectures=["Qwen3_5MoeForConditionalGeneration"])
    vision = {**VISION, "out_hidden_size": cfg["text_config"]["hidden_size"], "model_type": family}
    cfg.update(
        vision_config=vision,
        image_token_id=VISION_TOKENS["<|image_pad|>"],
        video_token_id=VISION_TOKENS["<|video_pad|>"],
        vision_start_token_id=VISION_TOKENS["<|vision_start|>"],
        vision_end_token_id=VISION_TOKENS["<|vision_end|>"],
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
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
