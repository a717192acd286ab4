"""The fused-input trunk most MTP heads share; a family declares only what differs.

The trunk: ``x = proj(cat[emb_norm(embed(t_{i+1})), hidden_norm(h_i)])`` (the halves in
``CONCAT_ORDER``), one decoder block on the head's cache, then the head's final norm where
it has one. ``logits``: an optional ``shared_head.norm``, then the head's own output matrix
(``shared_head.head``, when stored and asked for) or the main lm_head.

Rules:
- A family file declares its parameter names as published (``EMB_NORM``, ``HIDDEN_NORM``,
  ``PROJ``, ``BLOCK``, ``FINAL_NORM``), its norm class and the config field of its eps,
  the block (``_make_block``), the mask form (``MASK_ARRAY`` for latent attention, a
  sliding ``window`` from ``_window``) and its output head (``SHARED_HEAD_NORM``,
  ``HAS_OWN_LM_HEAD``). A convention the declarations cannot state (a block stack, a
  hidden read in another form) overrides the one step it changes: ``_norm_hidden``,
  ``_run_block``, ``_finish``, ``logits``.
- Parameters are created in one order (embedding norm, hidden norm, projection, block,
  final norm, shared head): a seeded random head does not depend on how it is declared.
- ``BLOCK = "layers"`` holds the block(s) as a list (``layers.{i}.*``); any other name
  holds one block module.
- ``CHAIN_POST_NORM`` stays each family's declared fact (what depth k > 1 is fed); the
  trunk returns exactly that hidden.
- The main model's final norm (``READS_MAIN_NORM``) is held by reference, outside the
  head's parameters, like its embedding and lm_head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...runtime.window_kv import WindowedKVCache
from ._base import MTPHeadBase

PRE_NORM_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class MainNorm:
    """Plain holder: the main model's final norm stays out of the head's parameters."""

    def __init__(self, norm: nn.Module | None) -> None:
        self.norm = norm


class SharedHead(nn.Module):
    """``shared_head``: an optional norm before the output, an optional own output matrix."""

    def __init__(self, dim: int, vocab: int, norm: nn.Module | None, own_lm_head: bool) -> None:
        super().__init__()
        if norm is not None:
            self.norm = norm
        if own_lm_head:
            self.head = nn.Linear(dim, vocab, bias=False)


class FusedTrunkHead(MTPHeadBase):
    """``proj(cat[emb_norm(emb), hidden_norm(h)])`` -> block -> [final norm]; see the rules."""

    EMB_NORM: ClassVar[str] = "enorm"
    HIDDEN_NORM: ClassVar[str] = "hnorm"
    PROJ: ClassVar[str] = "eh_proj"
    PROJ_BIAS: ClassVar[str | None] = None  # the config field that gives the projection a bias
    BLOCK: ClassVar[str] = "block"
    FINAL_NORM: ClassVar[str | None] = None  # None: the block output is the trunk's output
    SHARED_HEAD_NORM: ClassVar[bool] = False  # logits = head(shared_head.norm(x))
    NORM: ClassVar[Callable[..., nn.Module]] = nn.RMSNorm
    EPS: ClassVar[str] = "rms_norm_eps"  # the config field of every head norm's eps
    MASK_ARRAY: ClassVar[bool] = False  # latent attention wants a boolean array (or None)
    # The block is `h = x + attention(norm_in(x), mask, cache); h + mlp(norm_post(h))`; its
    # parts by name (norm_in, attention, norm_post, mlp), or None for a block that is not.
    BLOCK_PARTS: ClassVar[tuple[str, str, str, str] | None] = PRE_NORM_PARTS

    def __init__(
        self,
        args: Any,
        embed_tokens: nn.Module,
        lm_head: Callable[[mx.array], mx.array],
        *,
        own_lm_head: bool = False,
        main_norm: nn.Module | None = None,
    ) -> None:
        super().__init__(embed_tokens, lm_head)
        if self.READS_MAIN_NORM and main_norm is None:
            raise ValueError(f"the {self.FAMILY} head needs the main model's final norm (MTPHead.from_model)")
        d, eps = args.hidden_size, getattr(args, self.EPS)
        self.own_lm_head = own_lm_head
        setattr(self, self.EMB_NORM, self.NORM(d, eps=eps))
        setattr(self, self.HIDDEN_NORM, self.NORM(d, eps=eps))
        bias = bool(getattr(args, self.PROJ_BIAS)) if self.PROJ_BIAS else False
        setattr(self, self.PROJ, nn.Linear(2 * d, d, bias=bias))
        block = self._make_layers(args) if self.BLOCK == "layers" else self._make_block(args)
        setattr(self, self.BLOCK, block)
        if self.FINAL_NORM is not None:
            setattr(self, self.FINAL_NORM, self.NORM(d, eps=eps))
        if self.SHARED_HEAD_NORM or own_lm_head:
            norm = self.NORM(d, eps=eps) if self.SHARED_HEAD_NORM else None
            self.shared_head = SharedHead(d, args.vocab_size, norm, own_lm_head)
        self.window = self._window(args)
        self._main = MainNorm(main_norm)

    # -- what a family declares --------------------------------------------------------
    def _make_block(self, args: Any) -> nn.Module:
        raise NotImplementedError

    def _make_layers(self, args: Any) -> list[nn.Module]:
        return [self._make_block(args)]

    def _window(self, args: Any) -> int | None:
        """The head layer's sliding window (None: full attention)."""
        return None

    # -- the trunk, step by step ---------------------------------------------------------
    def trunk(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> mx.array:
        x = self._fused_input(hidden, next_tokens)
        if mask is None:
            mask = self._mask(x, self._first(cache))
        return self._finish(self._run_block(x, mask, cache))

    def trunk_at(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None, at: mx.array
    ) -> mx.array:
        """The trunk read at slot `at` [B, 1, 1]: attention over every slot (each writes the
        head's cache), the MLP at that slot only. A catch-up over a cycle's K + 1 verified
        slots otherwise runs the MLP, a MoE head's experts, K times for nothing."""
        if self.BLOCK_PARTS is None:
            return super().trunk_at(hidden, next_tokens, cache, at)
        x = self._fused_input(hidden, next_tokens)
        norm_in, attention, norm_post, mlp = (getattr(self._block(), name) for name in self.BLOCK_PARTS)
        layer_cache = self._first(cache)
        h = x + attention(norm_in(x), self._mask(x, layer_cache), layer_cache)
        h = mx.take_along_axis(h, at, axis=1)
        return self._finish(h + mlp(norm_post(h)))

    def _fused_input(self, hidden: mx.array, next_tokens: mx.array) -> mx.array:
        e = getattr(self, self.EMB_NORM)(self.embed(next_tokens))
        h = self._norm_hidden(hidden)
        halves = [e, h] if self.CONCAT_ORDER == "embedding_first" else [h, e]
        return getattr(self, self.PROJ)(mx.concatenate(halves, axis=-1))

    def _norm_hidden(self, hidden: mx.array) -> mx.array:
        return getattr(self, self.HIDDEN_NORM)(hidden)

    def _mask(self, x: mx.array, cache: Any) -> Any:
        return create_attention_mask(x, cache, window_size=self.window, return_array=self.MASK_ARRAY)

    def _run_block(self, x: mx.array, mask: Any, cache: list[Any] | None) -> mx.array:
        return self._block()(x, mask=mask, cache=self._first(cache))

    def _block(self) -> nn.Module:
        """The decoder block the trunk runs (the first of ``layers``)."""
        block = getattr(self, self.BLOCK)
        return block[0] if self.BLOCK == "layers" else block

    def _finish(self, out: mx.array) -> mx.array:
        """The trunk's output, what depth k > 1 chains (post-norm where FINAL_NORM is set)."""
        return out if self.FINAL_NORM is None else getattr(self, self.FINAL_NORM)(out)

    def logits(self, head_hidden: mx.array) -> mx.array:
        x = self.shared_head.norm(head_hidden) if self.SHARED_HEAD_NORM else head_hidden
        return self.shared_head.head(x) if self.own_lm_head else self.main_lm_head(x)

    def make_cache(self) -> list[Any]:
        if self.window is None:
            return [KVCache() for _ in range(self.NUM_LAYERS)]
        return [WindowedKVCache.unevicted(self.window) for _ in range(self.NUM_LAYERS)]
