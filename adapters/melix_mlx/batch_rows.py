"""The per-row records of the batched generator (melix_mlx.batch_generator).

Rules of this module:
- `RowState` is what a Batch row's payload slot holds: everything speculative about one
  sequence that must survive `extend` / `filter` (pending head pairs, draft count,
  sampler, stop matcher, token context). It is plain data; the generator owns the logic.
- `MTPResponse` has mlx-lm's `GenerationBatch.Response` fields plus `from_draft` and, on
  the finishing response, the row's speculative `stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences

from .sampling import SamplingParams


@dataclass
class MTPResponse:
    """mlx-lm's GenerationBatch.Response fields, plus `from_draft` and final `stats`."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None
    from_draft: bool = False
    stats: dict[str, Any] | None = None


@dataclass
class RowState:
    """The per-row speculative state kept in the Batch row's payload slot."""

    context: list[int]  # every token in this row's main cache, in order
    y: int  # the last emitted token, not yet fed to the main model
    sampler: Any
    params: SamplingParams | None
    processors: tuple
    max_tokens: int
    matcher: Any
    k: int
    num_generated: int = 0
    refusal: str | None = None
    fault: str | None = None
    pending_hidden: mx.array | None = None  # [L, D] main hiddens not yet fed to the head
    pending_tokens: list[int] = field(default_factory=list)

    def queue(self, hidden: mx.array, tokens: list[int]) -> None:
        if self.pending_hidden is None:
            self.pending_hidden = hidden
        else:
            self.pending_hidden = mx.concatenate([self.pending_hidden, hidden], axis=0)
        self.pending_tokens.extend(tokens)

    def take(self, n: int) -> tuple[mx.array, list[int]]:
        hidden, tokens = self.pending_hidden[:n], self.pending_tokens[:n]
        if n >= len(self.pending_tokens):
            self.pending_hidden, self.pending_tokens = None, []
        else:
            self.pending_hidden = self.pending_hidden[n:]
            self.pending_tokens = self.pending_tokens[n:]
        return hidden, tokens


@dataclass
class InsertRequest:
    uid: int
    prompt: list[int]
    max_tokens: int
    cache: list[Any] | None
    all_tokens: list[int]
    sampler: Any
    processors: tuple
    stop: StopSequences
    k: int
