"""mlx-vlm's language model seen as an mlx-lm text model, so the cycle engine decodes it.

Rules:
- ``VLMText`` wraps a loaded mlx-vlm model (``language_model`` and ``vision_tower``) in the
  shape ``melix_mlx.runtime.hidden.main_parts`` reads: ``language_model.model`` (an inner
  module: embedding, layers, norm, returning the post-norm hidden), ``language_model.lm_head``,
  ``args`` (mlx-lm's ``ModelArgs`` for the text config, what the head is built from) and
  ``make_cache`` (mlx-lm's caches, which mlx-vlm's layers accept and the engine rolls back).
  The layers and weights are mlx-vlm's own, held by reference: nothing is copied or patched.
- Positions are multimodal RoPE positions, as mlx-vlm computes them. A prompt is prepared
  once by mlx-vlm's own ``get_input_embeddings`` (``VLMText.features``: the vision tower's
  features merged into the embeddings, the (3, 1, n) position ids and the rope delta) and
  rides on the row's cache (``VLMText.prompt_cache``: its first recurrent leaf holds it).
  Forwards over prompt positions take the prompt's embeddings and position ids; forwards
  past the prompt (verify, replay, plain steps) take the token embeddings at
  ``offset + delta``, as mlx-vlm's generate carries its rope delta across decode steps.
  A forward that crosses the prompt's end is a ValueError (the decoders never make one).
- Batched rows: each row is prefilled alone on its own cache (its prompt features on it);
  once rows are merged into batch caches (a KV leaf with per-row offsets), every forward
  is past the prompts, and each row's position is its KV offset plus its own delta. The
  deltas travel with the rows: every recurrent leaf carries them ([B]) through mlx-lm's
  ``merge``, ``extend``, ``filter`` and ``extract``, which move rows. A batched forward
  runs mlx-vlm's layers in the order and with the masks its model runs them, without its
  model's row-by-row fallbacks (which rebuild the caches the engine rolls back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5 as lm_qwen3_5
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from melix_fsm.reasons import RefusalReason

from ..loading.errors import UnsupportedServing
from ..runtime import capture
from ..runtime.cache_leaves import ARMED

ONE_ROW = (
    "the mlx-vlm adapter prefills one row at a time (rows join a batch through "
    "melix_mlx.vlm.batch, each on its own cache)"
)


@dataclass(frozen=True)
class Prompt:
    """One prompt as mlx-vlm prepares it: embeddings with the image features merged, its
    multimodal position ids and the rope delta of every position past it."""

    embeds: mx.array  # [1, n, D]
    positions: mx.array  # [3, 1, n]
    delta: int

    @property
    def length(self) -> int:
        return self.embeds.shape[1]


class _Arrays(ArraysCache):
    """mlx-lm's ``ArraysCache`` (what the engine snapshots, captures into and restores)
    with the two writes mlx-vlm's gated-delta layers make through their cache.

    Armed by ``melix_mlx.runtime.capture.arm``, it records the (conv window, recurrent
    state) after every position of the forward, from mlx-vlm's own operator: the window
    is a slice of the convolution's input, the states are the ones the recurrence returns
    when asked for its history. Unarmed, it keeps only the last window and state.

    It also carries the rows' rope deltas (``deltas``, [B]) through every reshape that
    moves rows, and a fresh row's prompt (``prompt``) until its prefill has read it.
    """

    deltas: mx.array | None = None  # [B] int32 (None: every row 0, or a single row's prompt)
    prompt: Prompt | None = None  # a single row's prompt features

    def row_deltas(self) -> mx.array:
        if self.deltas is not None:
            return self.deltas
        if self.prompt is not None:
            return mx.array([self.prompt.delta], dtype=mx.int32)
        return mx.zeros((self.batch_size,), dtype=mx.int32)

    @classmethod
    def merge(cls, caches: list[Any]) -> _Arrays:
        merged = super().merge(caches)
        merged.deltas = mx.concatenate([c.row_deltas() for c in caches])
        return merged

    def extend(self, other: Any) -> None:
        deltas = mx.concatenate([self.row_deltas(), other.row_deltas()])
        super().extend(other)
        self.deltas, self.prompt = deltas, None

    def filter(self, batch_indices: Any) -> None:
        deltas = self.row_deltas()
        super().filter(batch_indices)
        index = mx.array(batch_indices, dtype=mx.int32)  # an empty list too (every row left)
        self.deltas, self.prompt = deltas[index], None

    def extract(self, idx: int) -> _Arrays:
        row = _Arrays(len(self.cache))
        row.cache = [c[idx : idx + 1] for c in self.cache]
        row.deltas = self.row_deltas()[idx : idx + 1]
        return row

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


def _batched(cache: Any) -> bool:
    """A batch cache leaf (per-row offsets), as mlx-lm's merge makes them."""
    offset = getattr(cache, "offset", None)
    return isinstance(offset, mx.array) and offset.ndim > 0


class _Inner(nn.Module):
    """Embedding, layers and final norm of mlx-vlm's language model, at mRoPE positions."""

    def __init__(self, vlm_inner: nn.Module) -> None:
        super().__init__()
        self._vlm = _Ref(vlm_inner)  # called, not a child: each layer is in the tree once
        self.embed_tokens = vlm_inner.embed_tokens
        self.layers = vlm_inner.layers
        self.fa_idx = vlm_inner.fa_idx
        self.ssm_idx = vlm_inner.ssm_idx

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **_: Any) -> mx.array:
        if cache is not None and _batched(cache[self.fa_idx]):
            return self._rows(inputs, cache)
        if inputs.shape[0] != 1:
            raise UnsupportedServing(RefusalReason.unsupported_model, ONE_ROW)
        start, n = _offset(cache, self.fa_idx), inputs.shape[1]
        prompt = getattr(cache[self.ssm_idx], "prompt", None) if cache else None
        prompt_len = 0 if prompt is None else prompt.length
        if start + n <= prompt_len:
            embeds = prompt.embeds[:, start : start + n]
            positions = prompt.positions[:, :, start : start + n]
        elif start >= prompt_len:
            delta = 0 if prompt is None else prompt.delta
            embeds = self.embed_tokens(inputs)
            positions = mx.broadcast_to(mx.arange(start, start + n)[None, None] + delta, (3, 1, n))
        else:  # the decoders feed the prompt in chunks inside it, then tokens after it
            raise ValueError(f"a forward over positions {start}..{start + n} crosses the prompt's end")
        return self._vlm.module(inputs, inputs_embeds=embeds, cache=cache, position_ids=positions)

    def _rows(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """A forward of batched rows, all past their prompts: row b at its KV offset + delta."""
        B, L = inputs.shape
        deltas = cache[self.ssm_idx].row_deltas()
        start = cache[self.fa_idx].offset + deltas
        positions = mx.broadcast_to((start[:, None] + mx.arange(L)[None])[None], (3, B, L))
        h = self.embed_tokens(inputs)
        fa_mask = create_attention_mask(h, cache[self.fa_idx])
        ssm_mask = create_ssm_mask(h, cache[self.ssm_idx])
        rotary = self.layers[self.fa_idx].self_attn.rotary_emb
        embeddings = None if rotary.fused_apply else rotary(h, positions)  # as mlx-vlm's model
        for layer, c in zip(self.layers, cache):
            h = layer(
                h,
                mask=ssm_mask if layer.is_linear else fa_mask,
                cache=c,
                position_ids=positions,
                position_embeddings=embeddings,
            )
        return self._vlm.module.norm(h)


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

    def features(self, input_ids: mx.array, pixel_values: mx.array | None = None, **kw: Any) -> Prompt:
        """The prompt ``input_ids`` [1, n] (with its images) prepared by mlx-vlm's own
        ``get_input_embeddings``: vision tower, embedding merge, multimodal positions."""
        if input_ids.shape[0] != 1:
            raise UnsupportedServing(RefusalReason.unsupported_model, ONE_ROW)
        feats = self._vlm.module.get_input_embeddings(input_ids, pixel_values, **kw)
        n = input_ids.shape[1]
        positions = feats.position_ids
        if positions is None:
            positions = mx.broadcast_to(mx.arange(n)[None, None], (3, 1, n))
        elif positions.ndim == 2:
            positions = mx.broadcast_to(positions[None], (3, *positions.shape))
        delta = feats.rope_deltas
        prompt = Prompt(
            embeds=feats.inputs_embeds,
            positions=positions,
            delta=0 if delta is None else int(mx.array(delta).reshape(-1)[0].item()),
        )
        mx.eval(prompt.embeds, prompt.positions)
        return prompt

    def prompt_cache(self, prompt: Prompt) -> list[Any]:
        """A fresh cache for one row that prefills ``prompt`` (its features ride on it)."""
        cache = self.make_cache()
        cache[self.language_model.model.ssm_idx].prompt = prompt
        return cache

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kw: Any) -> mx.array:
        return self.language_model(inputs, cache)
