"""Prompt processing for the batched generator: a joining row's prefill, first token and head.

mlx-lm's BatchGenerator keeps prompt processing apart from its generation batch; this is
that half of `MTPBatchGenerator`. Rules of this module:
- A joining row is prefilled alone, on its own cache (mlx-lm's, or the one the caller
  inserted), after any segments fed earlier (melix_mlx.batch_surface): its first token
  is drawn from the prefill's last logits, as mlx-lm draws it.
- Its head is primed from the prompt's pairs (h_i, t_{i+1}) and drafts the first cycle,
  unless the policy is disabled (no head work at all). Every row's head follows its
  context, a refused row's too: batch shapes stay uniform.
- A row whose sampler's distribution is unknown is refused here with a typed reason
  (`unsupported_sampler`); the generator turns the row's refusal into its lifecycle event.
- Everything is evaluated before the row joins: admission merges finished caches only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm.reasons import RefusalReason, refusal_text

from .batch_rows import InsertRequest, RowState
from .engine import CycleEngine, RowHead
from .prefill import prefill_with_hidden
from .sampling import normalize_logits, params_of
from .token_history import TokenHistory


@dataclass
class PreparedRow:
    """A prefilled row, ready to join the generation batch."""

    state: RowState
    cache: list[Any]
    head_cache: list[Any]
    head: RowHead
    first_logprobs: mx.array  # [V] of its first token


def whole_prompt(request: InsertRequest, hiddens: mx.array) -> tuple[mx.array, list[int]]:
    """Hidden states and tokens of every segment prefilled for this request, in order."""
    if not request.hiddens:
        return hiddens, request.prompt
    return mx.concatenate([*request.hiddens, hiddens], axis=0), request.prefilled + request.prompt


def prepare_row(
    model: nn.Module,
    head: nn.Module | None,
    engine: CycleEngine,
    request: InsertRequest,
    *,
    refusal: str | None,
    head_disabled: bool,
    max_kv_size: int | None,
    prefill_step_size: int,
) -> PreparedRow:
    """Prefill one row alone; draw its first token; prime its head cache from the prompt."""
    cache = request.cache or make_prompt_cache(model, max_kv_size)
    logits, hiddens = prefill_with_hidden(model, mx.array(request.prompt), cache, prefill_step_size)
    hiddens, fed = whole_prompt(request, hiddens)  # earlier segments included
    context = request.all_tokens + request.prompt
    state = RowState(
        context=context,
        y=0,
        sampler=request.sampler,
        params=params_of(request.sampler),
        processors=request.processors,
        max_tokens=request.max_tokens,
        matcher=request.stop.matcher(),
        k=request.k,
        history=TokenHistory(context) if request.processors else None,
    )
    logprobs = first_logprobs(state, logits)
    state.y = int(engine.agreed(state.sampler(logprobs)).item())  # rank 0's under a group
    if refusal is None and state.params is None:
        why = "unknown sampler: its distribution cannot be verified"
        refusal = refusal_text(RefusalReason.unsupported_sampler, why)
    state.refusal = refusal
    head_cache = head.make_cache() if head is not None else []
    row_head = RowHead()
    if head is not None and not head_disabled:
        row_head = engine.prime(head_cache, hiddens, [*fed[1:], state.y], state.params)
        mx.eval([c.state for c in head_cache], row_head.draft)
    mx.eval([c.state for c in cache])
    return PreparedRow(state, cache, head_cache, row_head, logprobs[0])


def first_logprobs(state: RowState, logits: mx.array) -> mx.array:
    """Processed log-probs [1, V] of a prefill's last position."""
    if state.history is not None:
        history = state.history.upto()
        for processor in state.processors:
            logits = processor(history, logits)
    return normalize_logits(logits)
