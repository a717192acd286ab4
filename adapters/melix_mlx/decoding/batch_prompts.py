"""Prompt processing for the batched generator: a joining row's prefill, first token and head.

mlx-lm's BatchGenerator keeps prompt processing apart from its generation batch; this is
that half of `MTPBatchGenerator`. Rules of this module:
- Joining rows with nothing cached yet are prefilled together, one forward per chunk
  for all of them, as mlx-lm's BatchGenerator prefills its prompts (`prepare_rows`);
  a row the caller inserted a cache for, or whose earlier segments were fed
  (melix_mlx.decoding.batch_surface), is prefilled alone on its own cache (`prepare_row`). Its
  first token is drawn from the prefill's last logits, as mlx-lm draws it.
- Its head is primed from the prompt's pairs (h_i, t_{i+1}) and drafts the first cycle,
  unless the policy is disabled (no head work at all). Every row's head follows its
  context, a refused row's too: batch shapes stay uniform.
- A row whose sampler's distribution is unknown is refused here with a typed reason
  (`unsupported_sampler`); the generator turns the row's refusal into its lifecycle event.
- Everything is evaluated before the row joins: admission merges finished caches only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm.reasons import RefusalReason, refusal_text

from ..runtime.engine import CycleEngine
from ..runtime.engine_records import RowHead
from ..runtime.prefill import prefill_together, prefill_with_hidden
from ..runtime.sampling import UNKNOWN_SAMPLER, normalize_logits, params_of
from ..runtime.token_history import TokenHistory
from .batch_rows import InsertRequest, RowState


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
    score_prompts: bool = False,
) -> PreparedRow:
    """Prefill one row alone; draw its first token; prime its head cache from the prompt."""
    cache = request.cache or make_prompt_cache(model, max_kv_size)
    logits, hiddens = prefill_with_hidden(model, mx.array(request.prompt), cache, prefill_step_size)
    return _ready(
        model, head, engine, request, cache, logits, hiddens,
        refusal, head_disabled, prefill_step_size, score_prompts,
    )


def joins_fresh(request: InsertRequest) -> bool:
    """Nothing of this request is in a cache yet: it can be prefilled with others."""
    return request.cache is None and not request.hiddens


# Joining prompts are padded to the longest of their group; a group takes a prompt only
# while its padding stays at most this share of its real tokens. Padding is wasted work:
# on the CPU a joint prefill of attention layers costs about what separate ones cost plus
# the padding, while recurrent layers, whose per-position steps are shared by the batch,
# gain the most from joining (benchmarks/bench_prefill.py).
MAX_PADDING = 0.25


def join_groups(requests: list[InsertRequest], max_padding: float = MAX_PADDING) -> list[list[InsertRequest]]:
    """Fresh requests (`joins_fresh`) in groups to prefill together, shortest prompts first;
    each group's padding to its longest prompt is at most `max_padding` of its tokens."""
    groups: list[list[InsertRequest]] = []
    tokens = 0
    for request in sorted(requests, key=lambda r: len(r.prompt)):
        n = len(request.prompt)
        group = groups[-1] if groups else None
        if group is not None and n * (len(group) + 1) - (tokens + n) <= max_padding * (tokens + n):
            group.append(request)
            tokens += n
        else:
            groups.append([request])
            tokens = n
    return groups


def prepare_rows(
    model: nn.Module,
    head: nn.Module | None,
    engine: CycleEngine,
    requests: list[InsertRequest],
    *,
    refusal: str | None,
    head_disabled: bool,
    max_kv_size: int | None,
    prefill_step_size: int,
    score_prompts: bool = False,
) -> Iterator[PreparedRow]:
    """Prefill fresh requests (`joins_fresh`) together, one forward per chunk for all of
    them as mlx-lm's BatchGenerator prefills its prompts; then yield each row, in order, as
    `prepare_row` would make it. A row that raises stops the iteration there: the rows
    yielded before it are whole (each drew its first token once)."""
    cache = _merge_caches([make_prompt_cache(model, max_kv_size) for _ in requests])
    logits, hiddens = prefill_together(model, [r.prompt for r in requests], cache, prefill_step_size)
    mx.eval(logits, [c.state for c in cache])
    for i, request in enumerate(requests):
        own = [c.extract(i) for c in cache]
        yield _ready(
            model, head, engine, request, own, logits[i : i + 1], hiddens[i],
            refusal, head_disabled, prefill_step_size, score_prompts,
        )


def _ready(
    model: nn.Module,
    head: nn.Module | None,
    engine: CycleEngine,
    request: InsertRequest,
    cache: list[Any],
    logits: mx.array,
    hiddens: mx.array,
    refusal: str | None,
    head_disabled: bool,
    step_size: int,
    score_prompt: bool,
) -> PreparedRow:
    """A prefilled row's state, first token and primed head (a sampled row's prompt
    scored when `score_prompt`: melix_mlx.runtime.prompt_score)."""
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
        refusal = refusal_text(RefusalReason.unsupported_sampler, UNKNOWN_SAMPLER)
    state.refusal = refusal
    head_cache = head.make_cache() if head is not None else []
    row_head = RowHead()
    if head is not None and not head_disabled:
        pairs = [*fed[1:], state.y]
        row_head = engine.prime(head_cache, hiddens, pairs, state.params, step_size, score_prompt)
        mx.eval([c.state for c in head_cache], row_head.draft, row_head.prompt_acceptance)
    mx.eval([c.state for c in cache])
    return PreparedRow(state, cache, head_cache, row_head, logprobs[0])


def first_logprobs(state: RowState, logits: mx.array) -> mx.array:
    """Processed log-probs [1, V] of a prefill's last position."""
    if state.history is not None:
        history = state.history.upto()
        for processor in state.processors:
            logits = processor(history, logits)
    return normalize_logits(logits)
