"""Shared by the mlx-vlm tests: one tiny VL checkpoint per family, loaded once per test process.

The checkpoints (melix_mlx.vlm.tiny.write_tiny_vl: the embedded stdlib-hybrid with a tiny
vision tower; ``qwen3_5`` dense, ``qwen3_5_moe`` its MoE variant) are written to a
temporary folder removed at exit; tests that modify a checkpoint copy it first. Importing
this module needs mlx-vlm (the tests skip first).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>def main(): w"
TEXT_PROMPT = "def main(): w"


@functools.cache
def tiny_vl(family: str = "qwen3_5") -> Path:
    from melix_mlx.vlm.tiny import write_tiny_vl

    root = Path(tempfile.mkdtemp(prefix="melix-tiny-vl-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return write_tiny_vl(root / f"tiny-vl-{family}", family=family)


@functools.cache
def loaded_vl(family: str = "qwen3_5") -> tuple[Any, Any, Any, Any]:
    """``load_vlm(tiny_vl(family))``: (model, processor, head, info), shared: never modify."""
    from melix_mlx.vlm import load_vlm

    return load_vlm(tiny_vl(family))


def image(seed: int) -> Any:
    """A 64 x 64 noise image (4 image tokens after the tiny processor's merge)."""
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((64, 64, 3)) * 255).astype(np.uint8))


def png_bytes(seed: int) -> bytes:
    import io

    out = io.BytesIO()
    image(seed).save(out, format="PNG")
    return out.getvalue()
