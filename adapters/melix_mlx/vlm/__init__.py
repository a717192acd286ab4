"""The mlx-vlm adapter (optional extra ``vlm``): vision-language checkpoints with images in
the prompt, prefilled by mlx-vlm (its processor and vision tower) and decoded by the cycle
engine with the MTP head loaded through the registry.

Rules:
- mlx-vlm (``pip install 'melix-fsm[vlm]'``) is imported inside the calls that load,
  process or compare (never at import); the mlx-lm path neither needs nor loads it. The
  CLI (``generate --vision``, melix_mlx.vlm.cli) and the server (``serve --vision``,
  melix_mlx.serve.images) reach this package only when asked for images.
- ``load_vlm`` (loading), ``VLMText`` (the language model as the engine's main model),
  ``prepare`` / ``generate`` / ``reference`` (one prompt, with images) and
  ``VLMBatchGenerator`` (batched rows with and without images) are the surface.
"""

from __future__ import annotations

from .batch import VLMBatchGenerator
from .generate import generate, placeholder, prepare, prompt_of, reference
from .load import VLMInfo, load_vlm
from .text import Prompt, VLMText

__all__ = [
    "Prompt",
    "VLMBatchGenerator",
    "VLMInfo",
    "VLMText",
    "generate",
    "load_vlm",
    "placeholder",
    "prepare",
    "prompt_of",
    "reference",
]
