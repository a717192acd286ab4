"""A multi-layer MTP head: N trained head layers, draft step i runs layer i.

Rules:
- Checkpoints with ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers`` = N > 1 ship N
  head layers; each is loaded into its own single-layer head of the family (shared
  pieces, e.g. qwen's ``mtp.fc``, are loaded into each). ``heads.{j}`` is layer j.
- Layer 0 is the head the engine drives everywhere: priming, catch-up on verified
  tokens and the cycle's first draft all run ``__call__`` = layer 0 on ``make_cache()``
  (layer 0's cache, which the engine trims and rolls back).
- Draft step i >= 1 of a cycle runs ``chain_step(i, ...)`` = layer ``min(i, N - 1)`` on the
  previous step's chained hidden and drafted token, as the family chains (DeepSeek's
  module k reads module k-1's output; qwen's step k reuses fc/norm with layer k). The
  last layer chains on itself for depths beyond N.
- Layers >= 1 attend over the current cycle's chain only: their scratch caches start
  empty at step 1 of every cycle and are never part of the engine's head cache, so
  trimming, rollback and batch reshapes see layer 0 alone. (They do not see the earlier
  context; that costs acceptance, never exactness: the target verifies every draft.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ._base import MTPHeadBase


class _Scratch:
    """Plain holder (outside the parameter tree) for the chain caches of layers >= 1."""

    def __init__(self) -> None:
        self.caches: dict[int, list[Any]] = {}


class StackedHead(nn.Module):
    """N single-layer heads of one family; see the module rules."""

    def __init__(self, layers: list[MTPHeadBase]) -> None:
        super().__init__()
        if len(layers) < 2:
            raise ValueError("a stacked head needs at least two layers")
        self.heads = list(layers)
        first = type(layers[0])
        self.FAMILY = first.FAMILY
        self.CHAIN_POST_NORM = first.CHAIN_POST_NORM
        self.CONCAT_ORDER = first.CONCAT_ORDER
        self.NUM_LAYERS = len(layers)
        self._scratch = _Scratch()

    def make_cache(self) -> list[Any]:
        return self.heads[0].make_cache()

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> tuple[mx.array, mx.array]:
        return self.heads[0](hidden, next_tokens, cache, mask)

    def trunk(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> mx.array:
        return self.heads[0].trunk(hidden, next_tokens, cache, mask)

    def trunk_at(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None, at: mx.array
    ) -> mx.array:
        return self.heads[0].trunk_at(hidden, next_tokens, cache, at)

    def at_slot(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None, at: mx.array
    ) -> tuple[mx.array, mx.array]:
        return self.heads[0].at_slot(hidden, next_tokens, cache, at)

    def logits(self, head_hidden: mx.array) -> mx.array:
        return self.heads[0].logits(head_hidden)

    def layer_for_step(self, step: int) -> int:
        """The head layer draft step ``step`` (0 = the cycle's first draft) runs."""
        return min(step, len(self.heads) - 1)

    def chain_step(self, step: int, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Draft step ``step`` >= 1: layer ``layer_for_step(step)`` on its chain cache."""
        if step < 1:
            raise ValueError("chain steps start at 1; step 0 is the head's own call")
        if step == 1:
            self._scratch.caches = {}
        layer = self.layer_for_step(step)
        if layer not in self._scratch.caches:  # the family's own cache form (DSA: a CacheList)
            self._scratch.caches[layer] = self.heads[layer].make_cache()
        cache = self._scratch.caches[layer]
        return self.heads[layer](hidden, tokens, cache)
