"""MTP head repositories as sidecar packs: the split-drafter layout, read and written.

The layout (what mlx-vlm's ``split_mtp`` writes and the community publishes beside
mlx conversions that dropped their head):
- ``config.json``: ``model_type`` ``qwen3_5_mtp`` (for every Qwen family), ``block_size``
  (head depth + 2), ``tie_word_embeddings`` and the source's whole ``text_config``;
- ``model.safetensors`` (metadata ``format: mlx``): the head's tensors with the raw
  ``mtp.`` prefix stripped, in MLX form: (1+w) norms already +1, experts already stacked
  into ``switch_mlp``; no embedding, no lm_head (the target's are used);
- the source's tokenizer files.

Rules:
- A pack is in this layout when its config carries a ``text_config`` and none of its keys
  is a raw head key (``is_split_pack``). Its tensors are then the head's own parameter
  names, layer ``j`` under ``layers.{j}.``; ``split_layers`` hands each head layer its
  tensors as ``layers.0.*`` plus the shared ones, loaded as is (no norm repair: a pack
  with raw norms fails the contract's probe, never silently repaired).
- Only families whose raw head lives under a single ``mtp.`` block (the Qwen3.5 / Next
  layout) have this layout; any other family is ``UnsupportedModel``.
- ``write_pack`` (tests and ``melix-fsm``) builds a pack from a checkpoint that holds its
  head, from the family's own raw-tensor mapping; it never calls mlx-vlm.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_config

from .errors import MissingHeadWeights, UnsupportedModel
from .families import advertised_head_count, detect_family, text_config
from .head_weights import MELIX_KEY_PREFIX, read_head_weights
from .heads import FAMILY_MODULES

PACK_FILE = "model.safetensors"
# families whose raw head is one mtp. block -> the pack's model_type (one drafter runtime
# for the three: the source's text_config tells them apart)
SPLIT_FAMILIES = {"qwen3_5": "qwen3_5_mtp", "qwen3_5_moe": "qwen3_5_mtp", "qwen3_next": "qwen3_5_mtp"}
BLOCK_SIZE_EXTRA = 2  # Qwen families: block_size = head depth + 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def is_split_pack(pack_cfg: dict[str, Any], keys: list[str], family: str, config: dict[str, Any]) -> bool:
    """The pack is in the split-drafter layout (its keys are head parameter names)."""
    if not isinstance(pack_cfg.get("text_config"), dict) or not keys:
        return False
    is_head = FAMILY_MODULES[family].is_head_key
    tcfg = text_config(config)
    return not any(k.startswith(MELIX_KEY_PREFIX) or is_head(k, tcfg) for k in keys)


def split_layers(tensors: dict[str, mx.array], family: str, layers: int, path: Path) -> dict[int, dict]:
    """``{j: head layer j's parameters}`` from a split pack's tensors (layer j -> ``layers.0``)."""
    if family not in SPLIT_FAMILIES:
        raise UnsupportedModel(
            f"{path}: the split-drafter pack layout is defined for {sorted(SPLIT_FAMILIES)}, not {family}",
            details={"family": family},
        )
    shared = {k: v for k, v in tensors.items() if not _LAYER.fullmatch(k)}
    out: dict[int, dict[str, mx.array]] = {j: dict(shared) for j in range(layers)}
    for key, value in tensors.items():
        m = _LAYER.fullmatch(key)
        if m is None:
            continue
        j = int(m.group(1))
        # a layer the config does not count stays in layer 0, where the shape check names it
        out[j if j in out else 0][f"layers.{0 if j in out else j}.{m.group(2)}"] = value
    empty = [j for j, w in out.items() if not any(k.startswith("layers.0.") for k in w)]
    if empty:
        raise MissingHeadWeights(f"{path}: no tensors for MTP layer(s) {empty}", details={"missing": empty})
    return out


def write_pack(source: str | Path, out: str | Path) -> Path:
    """Write the head of ``source`` (a checkpoint holding it) as a split-drafter pack in ``out``."""
    source, out = Path(source), Path(out)
    config = load_config(source)
    family = detect_family(config)
    if family not in SPLIT_FAMILIES:
        raise UnsupportedModel(
            f"{source}: the split-drafter pack layout is defined for {sorted(SPLIT_FAMILIES)}, not {family}",
            details={"family": family},
        )
    depth = max(advertised_head_count(config), 1)
    per_layer, fmt, _ = read_head_weights(source, config, family, list(range(depth)))
    if fmt != "hf":
        raise UnsupportedModel(f"{source}: write a pack from the original checkpoint, not a converted one")
    tensors: dict[str, mx.array] = {}
    for j, weights in per_layer.items():
        for key, value in weights.items():
            layered = key.startswith("layers.0.")
            tensors[f"layers.{j}.{key.removeprefix('layers.0.')}" if layered else key] = value
    text = dict(text_config(config))
    pack_cfg = {
        "model_type": SPLIT_FAMILIES[family],
        "text_config": text,
        "block_size": depth + BLOCK_SIZE_EXTRA,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", True)),
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.eval(list(tensors.values()))
    mx.save_safetensors(str(out / PACK_FILE), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(dict(sorted(pack_cfg.items())), indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out
