"""mlx-vlm's language model seen as an mlx-lm text model, so the cycle engine decodes it.

Rules:
- ``VLMText`` wraps a loaded mlx-vlm model (``language_model`` and ``vision_tower``) in the
  shape ``melix_mlx.runtime.hidden.main_parts`` reads: ``language_model.model`` (an inner
  module: embedding, layers, norm, returning the post-norm hidden), ``language_model.lm_head``,
  ``args`` (mlx-lm's ``ModelArgs`` for the text config, what the head is built from) and
  ``make_cache`` (mlx-lm's caches, which mlx-vlm's layers accept and the engine rolls back).
  The layers and weights are mlx-vlm's own, held by reference: nothing is copied or patched.
- Positions are multimodal RoPE positions, as mlx-vlm computes them: ``begin`` takes a
  prompt prepared by mlx-vlm's own ``get_input_embeddings`` (the vision tower's features
  merged into the embeddings, the (3, B, n) position ids and the rope delta). Forwards
  over prompt positions take the prompt's embeddings and position ids; forwards past the
  prompt (verify, replay, plain steps) take the token embeddings at ``offset + delta``.
  A forward that starts before the cache's offset is impossible by construction: the
  inner model reads the offset from the full-attention cache.
- One sequence at a time (batch 1): ``begin`` before each prompt; a forward of another
  batch size is ``UnsupportedServing``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5 as lm_qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache

from melix_fsm.reasons import RefusalReason

from ..loading.errors import UnsupportedServing
from ..runtime import capture
from ..runtime.cache_leaves import ARMED

ONE_ROW = "the mlx-vlm adapter decodes one sequence at a time (no batched rows yet)"


class _Arrays(ArraysCache):
    """mlx-lm's ``ArraysCache`` (what the engine snapshots, captures into and restores)
    with the two writes mlx-vlm's gated-delta layers make through their cache.

    Armed by ``melix_mlx.runtime.capture.arm``, it records the (conv window, recurrent
    state) after every position of the forward, from mlx-vlm's own operator: the window
    is a slice of the convolution's input, the states are the ones the recurrence returns
    when asked for its history. Unarmed, it keeps only the last window and state.
    """

    def update_window(self, index: int, source: mx.array, width: int, *, lengths: Any = None) -> mx.array:
        if lengths is not None:
            raise UnsupportedServing(RefusalReason.unsupported_model, ONE_ROW)
        width, steps = int(width), source.shape[1] - int(width)
        if getattr(self, ARMED, None) is not None:
            self._windows = [source[:, p : p + width] for p in range(1, steps + 1)]
        state = mx.contiguous(source[:, steps:])
        self.cache[index] = state
        return state

    def update_recurrent(self, index: int, length: int, update: Any) -> tuple[mx.array, mx.array]:
        recorded = getattr(self, ARMED, None)
        result = update(self.cache[index], length - 1 if recorded is not None and length > 1 else None)
        output, state = result[:2]
        if recorded is not None:
            between = [result[2][:, p] for p in range(length - 1)] if length > 1 else []
            windows = self.__dict__.pop("_windows")
            recorded.extend(zip(windows, [*between, state], strict=True))
        self.cache[index] = state
        return output, state


class _Ref:
    """Holds a module without making it a child (``nn.Module`` walks only its children)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


def _offset(cache: list[Any] | None, fa_idx: int) -> int:
    if not cache or cache[fa_idx] is None:
        return 0
    off = cache[fa_idx].offset
    return int(off.item()) if isinstance(off, mx.array) else int(off)


class _Inner(nn.Module):
    """Embedding, layers and final norm of mlx-vlm's language model, at mRoPE positions."""

    def __init__(self, vlm_inner: nn.Module) -> None:
        super().__init__()
        self._vlm = _Ref(vlm_inner)  # called, not a child: each layer is in the tree once
        self.embed_tokens = vlm_inner.embed_tokens
        self.layers = vlm_inner.layers
        self.fa_idx = vlm_inner.fa_idx
        self.prompt_embeds: mx.array | None = None  # [1, n, D]
        self.prompt_positions: mx.array | None = None  # [3, 1, n]
        self.delta = 0  # mRoPE offset of every position past the prompt

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **_: Any) -> mx.array:
        if inputs.shape[0] != 1:
            raise UnsupportedServing(RefusalReason.unsupported_model, ONE_ROW)
        start, n = _offset(cache, self.fa_idx), inputs.shape[1]
        prompt_len = 0 if self.prompt_embeds is None else self.prompt_embeds.shape[1]
        if start + n <= prompt_len:
            embeds = self.prompt_embeds[:, start : start + n]
            positions = self.prompt_positions[:, :, start : start + n]
        elif start >= prompt_len:
            embeds = self.embed_tokens(inputs)
            positions = mx.broadcast_to(mx.arange(start, start + n)[None, None] + self.delta, (3, 1, n))
        else:  # the decoders feed the prompt in chunks inside it, then tokens after it
            raise ValueError(f"a forward over positions {start}..{start + n} crosses the prompt's end")
        return self._vlm.module(inputs, inputs_embeds=embeds, cache=cache, position_ids=positions)


def _register_capture(layers: list[nn.Module]) -> None:
    """Count mlx-vlm's gated-delta layers as capturing (their ``_Arrays`` cache records for
    them), so rollback selects captured states instead of refusing the cache."""
    for layer in layers:
        if layer.is_linear:
            kind = type(layer.linear_attn)
            capture.CAPTURING.setdefault(kind, kind)


class _Text(nn.Module):
    def __init__(self, vlm_text: nn.Module, args: Any) -> None:
        super().__init__()
        self.args = args
        self.model = _Inner(vlm_text.model)
        if "lm_head" in vlm_text:
            self.lm_head = vlm_text.lm_head

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kw: Any) -> mx.array:
        h = self.model(inputs, cache)
        return self.lm_head(h) if "lm_head" in self else self.model.embed_tokens.as_linear(h)


class VLMText(nn.Module):
    """A loaded mlx-vlm model as the cycle engine's main model (see the module rules)."""

    def __init__(self, vlm: nn.Module, text_config: dict[str, Any]) -> None:
        super().__init__()
        self._vlm = _Ref(vlm)  # the vision tower and wrapper stay outside the module tree
        args = lm_qwen3_5.TextModelArgs.from_dict(text_config)
        self.language_model = _Text(vlm.language_model, args)
        self.args = args
        self.model_type = "qwen3_5"
        _register_capture(self.layers)

    @property
    def vlm(self) -> nn.Module:
        """The mlx-vlm model this wraps (vision tower included)."""
        return self._vlm.module

    @property
    def layers(self) -> list[nn.Module]:
        return self.language_model.model.layers

    def make_cache(self) -> list[Any]:
        return [_Arrays(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def begin(self, input_ids: mx.array, pixel_values: mx.array | None = None, **kw: Any) -> list[int]:
        """Prepare the prompt ``input_ids`` [1, n] (with its image) through mlx-vlm; return its ids."""
        feats = self._vlm.module.get_input_embeddings(input_ids, pixel_values, **kw)
        inner = self.language_model.model
        n = input_ids.shape[1]
        positions = feats.position_ids
        if positions is None:
            positions = mx.broadcast_to(mx.arange(n)[None, None], (3, 1, n))
        elif positions.ndim == 2:
            positions = mx.broadcast_to(positions[None], (3, *positions.shape))
        delta = feats.rope_deltas
        inner.prompt_embeds = feats.inputs_embeds
        inner.prompt_positions = positions
        inner.delta = 0 if delta is None else int(mx.array(delta).reshape(-1)[0].item())
        mx.eval(inner.prompt_embeds, inner.prompt_positions)
        return input_ids[0].tolist()

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kw: Any) -> mx.array:
        return self.language_model(inputs, cache)
