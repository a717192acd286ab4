"""Finding and loading a checkpoint's model and MTP head: families, head weights and receipts, sidecar
packs, conversion, the embedded checkpoints, and one module per head family (heads/).

`melix_mlx.loading` itself is a public import path: it re-exports the loaders, lazily
(PEP 562), so reading one light module of this wing (`errors`, `checkpoints`, `families`)
does not import the loaders and mlx-lm's model code with it (the core's `receipt` runs
without mlx; `runtime.hidden` needs only `errors`)."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and the API docs read; at run time, `__getattr__`
    from .loaders import (
        MELIX_CONFIG_KEY,
        MELIX_FORMAT_VERSION,
        MELIX_KEY_PREFIX,
        SIDECAR_NAME,
        STACKED_PREFIX,
        HeadInfo,
        Loaded,
        build_head,
        load_main,
        load_with_heads,
        quantize_head_module,
        safetensors_keys,
    )

__all__ = [
    "HeadInfo",
    "Loaded",
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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".loaders", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
