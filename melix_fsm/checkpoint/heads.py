"""Which head tensors a checkpoint holds, and whether it is an MTP-only sidecar.

What a family's head looks like comes from the registry (spec/families.toml); this
module only matches the declared prefixes against the tensor names of the headers.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..registry import Family, SidecarMarkers
from .directory import MELIX_KEY_PREFIX, Checkpoint


class HeadScan(msgspec.Struct, frozen=True):
    """Head weights found for one family layout."""

    head_format: str  # "hf" (upstream names) or "melix" (converted)
    layer_counts: list[int]  # tensors per advertised head layer
    weight_count: int  # head tensors in total (layers + shared)
    missing: list[str]  # required prefixes with no tensor
    files: list[str]  # files holding head tensors

    @property
    def present(self) -> bool:
        return not self.missing and self.weight_count > 0


def _matches(key: str, prefix: str) -> bool:
    # A prefix matches at the start or after a "." so VL wrappers need no entry.
    return key.startswith(prefix) or f".{prefix}" in key


def scan_heads(ckpt: Checkpoint, family: Family, head_count: int, layer_count: int) -> HeadScan:
    """Which of the family's head tensors the checkpoint holds, per advertised layer."""
    if ckpt.melix_file is not None:
        melix_keys = [k for k, f in ckpt.keys.items() if k.startswith(MELIX_KEY_PREFIX)]
        if melix_keys:  # converted: every melix_mtp.* key is a head tensor, named as loaded
            files = sorted({ckpt.keys[k] for k in melix_keys})
            return HeadScan("melix", [len(melix_keys)], len(melix_keys), [], files)
    layout = family.weights
    assert layout is not None
    counts: list[int] = []
    missing: list[str] = []
    head_files: set[str] = set()
    claimed: set[str] = set()
    for j in range(head_count):
        prefix = layout.layer_prefix(j, layer_count)
        layer_keys = [k for k in ckpt.keys if _matches(k, prefix)]
        counts.append(len(layer_keys))
        claimed.update(layer_keys)
        if not layer_keys:
            missing.append(prefix)
            continue
        for sub in layout.layer_required:
            if not any(_matches(k, prefix + sub) for k in layer_keys):
                missing.append(prefix + sub)
    for prefix in layout.shared:
        shared_keys = [k for k in ckpt.keys if _matches(k, prefix)]
        claimed.update(shared_keys)
        if not shared_keys:
            missing.append(prefix)
    head_files.update(ckpt.keys[k] for k in claimed)
    return HeadScan("hf", counts, len(claimed), missing, sorted(head_files))


def head_only(ckpt: Checkpoint, scan: HeadScan) -> bool:
    """Every tensor in the checkpoint is a head tensor: an MTP-only (sidecar) checkpoint."""
    return bool(ckpt.keys) and scan.weight_count == len(ckpt.keys)


def sidecar_marker(config: dict[str, Any], markers: SidecarMarkers) -> str | None:
    """The first marker saying `config` describes an assistant / MTP-only checkpoint."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for cfg in (config, text):
        model_type = cfg.get("model_type")
        if isinstance(model_type, str):
            for suffix in markers.model_type_suffixes:
                if model_type.endswith(suffix):
                    return f"model_type {model_type!r} names an assistant/MTP-only checkpoint"
        archs = cfg.get("architectures")
        if isinstance(archs, list):
            for arch in archs:
                if isinstance(arch, str) and any(m in arch for m in markers.architecture_markers):
                    return f"architecture {arch!r} is an assistant/MTP-only checkpoint"
        for key in markers.config_keys:
            if key in cfg:
                return f"config key {key!r} marks an assistant/draft sidecar"
        layers = cfg.get("num_hidden_layers")
        if type(layers) is int and layers == 0:
            return "num_hidden_layers = 0: the checkpoint has no main model"
    return None
