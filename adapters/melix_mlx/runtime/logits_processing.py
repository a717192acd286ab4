"""Log-probabilities as the caller's logits processors and samplers shape them, inside a
cycle's graph (melix_mlx.runtime.engine).

Rules of this module:
- A processor sees the row's whole history before each position: the tokens before y
  (`RowPlan.history`, on the device), y, and the drafts up to that position, so a verify
  of k drafts is processed exactly as k + 1 plain steps would be; no sync is needed.
- An exception from the caller's own sampler or processor is theirs, not a speculative
  fault: it is wrapped as `CallerError` for the engine to restore its caches and re-raise
  the original (`call_caller`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .engine_records import CallerError, RowPlan
from .sampling import normalize_logits


def call_caller(fn: Callable[..., mx.array], *args: Any) -> mx.array:
    """Call a caller-supplied sampler or processor; its exceptions are the caller's."""
    try:
        return fn(*args)
    except Exception as exc:
        raise CallerError(exc) from exc


def processed_logprobs(plans: list[RowPlan], logits: mx.array, inputs: mx.array) -> mx.array:
    """Processed log-probabilities [B, L, V]; logits processors see the token history."""
    if not any(p.processors for p in plans):
        return normalize_logits(logits)
    rows = []
    for i, plan in enumerate(plans):
        if not plan.processors:
            rows.append(normalize_logits(logits[i]))
            continue
        # history, y and the drafts, all on the device: the processors need no sync
        before = plan.history if plan.history is not None else mx.zeros((0,), mx.uint32)
        context = mx.concatenate([before, inputs[i].astype(mx.uint32)])
        n = before.size
        positions = []
        for j in range(logits.shape[1]):
            history = context[: n + j + 1]
            row = logits[i, j : j + 1]
            for processor in plan.processors:
                row = call_caller(processor, history, row)
            positions.append(row)
        rows.append(normalize_logits(mx.concatenate(positions, axis=0)))
    return mx.stack(rows)
