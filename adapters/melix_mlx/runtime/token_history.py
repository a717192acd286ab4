"""A row's token context as one growing device array, for logits processors.

Rules of this module:
- mlx-lm's logits processors take the tokens so far as an mx.array. Rebuilding that array
  from a Python list every step costs O(context) host work per position; this buffer
  grows by doubling and appends in place, so a step costs O(new tokens).
- `upto(n)` is a lazy slice: a later append never changes an array handed out earlier
  (mlx's slice update replaces the buffer's graph node; earlier slices keep the old one).
- Token ids only; no sampler or processor logic lives here.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

_MIN_CAPACITY = 256


class TokenHistory:
    """Token ids appended over a row's life, readable as a device array prefix."""

    __slots__ = ("_buffer", "_length")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        capacity = max(_MIN_CAPACITY, 2 * len(tokens))
        self._buffer = mx.zeros((capacity,), dtype=mx.uint32)
        self._length = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: Sequence[int] | mx.array) -> None:
        """Append token ids (a list, or a 1-d array already on the device)."""
        values = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.uint32)
        k = values.size
        if k == 0:
            return
        end = self._length + k
        if end > self._buffer.size:
            grown = mx.zeros((max(2 * self._buffer.size, end),), dtype=mx.uint32)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : end] = values.reshape(-1).astype(mx.uint32)
        self._length = end

    def upto(self, n: int | None = None) -> mx.array:
        """The first `n` tokens (all by default) as a lazy [n] uint32 array."""
        n = self._length if n is None else n
        if not 0 <= n <= self._length:
            raise IndexError(f"history holds {self._length} tokens, asked for {n}")
        return self._buffer[:n]

    def tolist(self) -> list[int]:
        return self.upto().tolist()
