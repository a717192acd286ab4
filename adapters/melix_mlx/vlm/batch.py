"""Batched rows with and without images: mlx-vlm prefills each row, the batch decodes them.

Rules:
- ``VLMBatchGenerator`` is ``MTPBatchGenerator`` (continuous batching, per-row exact
  rollback, the lifecycle, controller and receipts unchanged) over ``VLMText``. The one
  difference is where a row's prompt comes from: every row gets a fresh cache carrying
  its prompt as mlx-vlm prepares it (``VLMText.features``: the vision tower's features
  merged, the multimodal positions, the rope delta), and the generator prefills a row
  with a cache of its own alone (melix_mlx.decoding.batch_prompts). A text row goes
  through mlx-vlm the same way, without pixels.
- ``insert_inputs`` takes what ``melix_mlx.vlm.prepare`` returns (mlx-vlm's processor
  output), one dict per row; ``insert`` takes token ids, as the generator's own does (text
  rows, or rows whose prompt the caller tokenized with the image placeholders expanded
  and whose features it passes as a prepared cache).
- The vision tower runs at insertion, in the caller's thread; the rows' rope deltas then
  travel with the rows (melix_mlx.vlm.text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..decoding.batch_generator import MTPBatchGenerator
from .generate import prompt_of
from .text import VLMText


class VLMBatchGenerator(MTPBatchGenerator):
    """``MTPBatchGenerator`` whose rows are prefilled through mlx-vlm; see the module rules."""

    model: VLMText

    def __init__(self, model: VLMText, head: Any, **kwargs: Any) -> None:
        if not isinstance(model, VLMText):
            raise TypeError(f"VLMBatchGenerator decodes a VLMText (load_vlm), not {type(model).__name__}")
        super().__init__(model, head, **kwargs)

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int] | None = None,
        caches: list[list[Any] | None] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> list[int]:
        """The generator's ``insert``; a row without a cache gets its text prompt's features."""
        given = list(caches) if caches is not None else [None] * len(prompts)
        if len(given) != len(prompts):
            raise ValueError(f"option caches needs one entry per prompt: {len(prompts)} != {len(given)}")
        rows = [
            c if c is not None else self.model.prompt_cache(self.model.features(mx.array([list(p)])))
            for p, c in zip(prompts, given)
        ]
        return super().insert(prompts, max_tokens, rows, *args, **kwargs)

    def insert_inputs(self, inputs: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Queue rows prepared by mlx-vlm's processor (``melix_mlx.vlm.prepare``); their uids.
        Keyword arguments are ``insert``'s (``max_tokens``, ``samplers``, ...)."""
        prompts, caches = [], []
        for row in inputs:
            ids, cache = prompt_of(self.model, row)
            prompts.append(ids)
            caches.append(cache)
        return self.insert(prompts, caches=caches, **kwargs)
