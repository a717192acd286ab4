"""Shared plumbing for the per-family MTP head modules.

Rules:
- The head owns only its own parameters. The main model's embedding and lm_head are
  held through a plain (non-Module) holder, so ``head.parameters()``, ``load_weights``
  and quantization never see or touch the main model's tensors.
- The head's attention cache is a list with one ``KVCache`` per head layer (trimmable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


class SharedRefs:
    """Plain holder: attributes that are not arrays or Modules stay out of the tree."""

    def __init__(self, embed: nn.Module, lm_head: Callable[[mx.array], mx.array]) -> None:
        self.embed = embed
        self.lm_head = lm_head


class MTPHeadBase(nn.Module):
    """Base for ``MTPHead`` classes. Subclasses set the class constants and layers."""

    FAMILY: ClassVar[str] = ""
    CHAIN_POST_NORM: ClassVar[bool] = True
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    NUM_LAYERS: ClassVar[int] = 1
    HAS_OWN_LM_HEAD: ClassVar[bool] = False  # the checkpoint may store its own output projection
    READS_MAIN_NORM: ClassVar[bool] = False  # the head applies the main model's final norm

    def __init__(self, embed_tokens: nn.Module, lm_head: Callable[[mx.array], mx.array]):
        super().__init__()
        self._shared = SharedRefs(embed_tokens, lm_head)

    @classmethod
    def from_model(cls, model: nn.Module, *, own_lm_head: bool = False) -> MTPHeadBase:
        """A head (random weights) wired to `model`'s embedding and lm_head.

        own_lm_head: for families whose checkpoints may store the head's own output
        projection (HAS_OWN_LM_HEAD), use it instead of the main lm_head. A head that
        READS_MAIN_NORM is given the main model's final norm as ``main_norm``.
        """
        from ...runtime.hidden import main_parts

        parts = main_parts(model)
        kwargs: dict[str, Any] = {}
        if cls.HAS_OWN_LM_HEAD:
            kwargs["own_lm_head"] = own_lm_head
        if cls.READS_MAIN_NORM:
            kwargs["main_norm"] = parts.inner.norm
        return cls(parts.args, parts.embed_tokens, parts.lm_head, **kwargs)

    @classmethod
    def from_weights(
        cls, model: nn.Module, weights: dict[str, mx.array], *, own_lm_head: bool = False
    ) -> MTPHeadBase:
        """The head `weights` (its parameter tensors, about to be loaded) fit: `from_model`
        for every family whose layout the config fixes; a head whose sub-layer layout is
        read from its tensors (nemotron_h) overrides this."""
        return cls.from_model(model, own_lm_head=own_lm_head)

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> tuple[mx.array, mx.array]:
        """(logits [B, L, V], head_hidden [B, L, D]): `trunk`, then `logits` at every slot."""
        out = self.trunk(hidden, next_tokens, cache, mask)
        return self.logits(out), out

    def trunk(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> mx.array:
        """head_hidden [B, L, D]: everything but the output projection (per family)."""
        raise NotImplementedError

    def trunk_at(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None, at: mx.array
    ) -> mx.array:
        """head_hidden [B, 1, D] at slot `at` [B, 1, 1] (int32): every slot writes the head's
        cache, one is read. Here the trunk runs whole; a block that splits into attention and
        MLP (trunk.FusedTrunkHead.BLOCK_PARTS) runs its MLP at that slot only."""
        return mx.take_along_axis(self.trunk(hidden, next_tokens, cache), at, axis=1)

    def at_slot(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None, at: mx.array
    ) -> tuple[mx.array, mx.array]:
        """(logits [B, V], head_hidden [B, 1, D]) at slot `at` [B, 1, 1]: what a draft reads."""
        out = self.trunk_at(hidden, next_tokens, cache, at)
        return self.logits(out)[:, 0], out

    def logits(self, head_hidden: mx.array) -> mx.array:
        """Draft logits [B, L, V] of `head_hidden` slots. The engine passes only the slots it
        draws from (one per row), not a prime's n or a cycle's K + 1."""
        raise NotImplementedError

    def embed(self, tokens: mx.array) -> mx.array:
        return self._shared.embed(tokens)

    def main_lm_head(self, h: mx.array) -> mx.array:
        return self._shared.lm_head(h)

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in range(self.NUM_LAYERS)]

    @staticmethod
    def _first(cache: list[Any] | None) -> Any:
        return cache[0] if cache else None
