"""Prompts with images through mlx-vlm's processor, decoded by the cycle engine.

Rules:
- ``prepare`` runs mlx-vlm's own ``prepare_inputs`` (its processor: chat text with the
  image placeholders, pixel values and the image grid); ``prompt_of`` then runs
  ``VLMText.features`` (mlx-vlm's vision tower and embedding merge, its multimodal
  positions) and puts them on a fresh cache for the prompt.
- ``generate`` then decodes with ``MTPDecoder`` (the lifecycle, controller and receipts of
  the mlx-lm path, unchanged) over the language model; ``reference`` is mlx-vlm's own
  greedy ``generate_step`` on the same inputs, the identity every test compares with.
- One sequence here; batched rows: melix_mlx.vlm.batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from ..decoding.decode import MTPDecoder
from .text import VLMText


def prepare(model: VLMText, processor: Any, prompt: str, images: list[Any] | None = None) -> dict[str, Any]:
    """mlx-vlm's inputs for ``prompt`` (its image placeholders already in the text)."""
    from mlx_vlm.utils import prepare_inputs

    inputs = prepare_inputs(processor, images=images or None, prompts=[prompt])
    if inputs["input_ids"].shape[0] != 1:
        raise ValueError("one prompt at a time")
    return inputs


def placeholder(tokenizer: Any, config: dict[str, Any]) -> str:
    """The text one image takes in a prompt (vision start, image pad, vision end), from the
    checkpoint's config; the processor expands the pad to the image's tokens."""
    ids = [config.get(k) for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id")]
    if any(i is None for i in ids):
        raise ValueError("the checkpoint's config names no vision start / image / vision end tokens")
    return "".join(tokenizer.convert_ids_to_tokens(ids))


def _vision_kw(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k in ("image_grid_thw", "video_grid_thw")}


def prompt_of(model: VLMText, inputs: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """``(prompt token ids, a fresh cache carrying its features)`` for prepared ``inputs``."""
    ids = inputs["input_ids"]
    prompt = model.features(ids, inputs.get("pixel_values"), **_vision_kw(inputs))
    return ids[0].tolist(), model.prompt_cache(prompt)


def generate(
    model: VLMText, head: Any, inputs: dict[str, Any], max_tokens: int, **decoder_kw: Any
) -> tuple[Iterator[tuple[int, mx.array, bool]], MTPDecoder]:
    """``(tokens as (token, logprobs, from_draft), the decoder)`` for prepared ``inputs``."""
    ids, cache = prompt_of(model, inputs)
    decoder = MTPDecoder(model, head, prompt_cache=cache, **decoder_kw)
    return decoder.generate(mx.array(ids), max_tokens), decoder


def reference(model: VLMText, inputs: dict[str, Any], max_tokens: int) -> list[int]:
    """mlx-vlm's own greedy tokens for the same inputs."""
    from mlx_vlm.generate.ar import generate_step

    steps = generate_step(
        inputs["input_ids"],
        model.vlm,
        inputs.get("pixel_values"),
        None,
        max_tokens=max_tokens,
        temperature=0.0,
        **_vision_kw(inputs),
    )
    return [int(t) for (t, _), _ in zip(steps, range(max_tokens), strict=False)]
