"""The per-row records of the batched generator (melix_mlx.batch_generator).

Rules of this module:
- `RowState` is what a Batch row's payload slot holds: everything about one sequence's
  decoding that must survive `extend` / `filter` on the host (draft count, sampler, stop
  matcher, token context). Its device-side head state (next draft, pending pairs) is
  the engine's row i (melix_mlx.runtime.engine.RowHead), filtered and extended with it.
  It is plain data; the generator owns the logic.
- `MTPResponse` has mlx-lm's `GenerationBatch.Response` fields plus `from_draft` and, on
  the finishing response, the row's speculative `stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import StopSequences

from melix_fsm.stats import GenerationStats

from ..runtime.sampling import SamplingParams
from ..runtime.token_history import TokenHistory


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
    stats: GenerationStats | None = None  # on the finishing response: the row's typed statistics


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
    # Why the row decodes plainly, as text: the lifecycle state (refused, faulted) is the
    # truth and the only thing code branches on; these carry the reason for stats.
    refusal: str | None = None  # also the resolution's input: a row that joins with one is refused
    fault: str | None = None
    history: TokenHistory | None = None  # `context` on the device, for logits processors only


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
    segments: list[list[int]] = field(default_factory=list)  # non-final segments not yet prefilled
    prefilled: list[int] = field(default_factory=list)  # segment tokens prefilled (in all_tokens too)
    hiddens: list[mx.array] = field(default_factory=list)  # their hidden states, to prime the head
