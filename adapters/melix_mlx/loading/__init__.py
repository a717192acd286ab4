"""Finding and loading a checkpoint's model and MTP head: families, head weights and receipts, sidecar
packs, conversion, the embedded checkpoints, and one module per head family (heads/).

`melix_mlx.loading` itself is a public import path: it re-exports the loaders."""

from .loaders import (
    MELIX_CONFIG_KEY,
    MELIX_FORMAT_VERSION,
    MELIX_KEY_PREFIX,
    SIDECAR_NAME,
    STACKED_PREFIX,
    HeadInfo,
    build_head,
    load_main,
    load_with_heads,
    quantize_head_module,
    safetensors_keys,
)

__all__ = [
    "HeadInfo",
    "MELIX_CONFIG_KEY",
    "MELIX_FORMAT_VERSION",
    "MELIX_KEY_PREFIX",
    "SIDECAR_NAME",
    "STACKED_PREFIX",
    "build_head",
    "load_main",
    "load_with_heads",
    "quantize_head_module",
    "safetensors_keys",
]
