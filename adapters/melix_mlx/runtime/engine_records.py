"""The records of a cycle's life in the engine (melix_mlx.runtime.engine): what a row plans for
the next step, its head state, a launched cycle or plain step (each carrying its plans and
rows' ids), a settled cycle, and the typed failures a step can raise.

Plain data only: the engine builds, settles and undoes them; the decoders read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from melix_fsm.errors import MelixError

from . import rollback
from .sampling import SamplingParams

Sampler = Callable[[mx.array], mx.array]


class CallerError(MelixError):
    """A caller's own sampler or logits processor raised inside a cycle.

    It is the caller's bug, not a speculative fault: the engine restores its caches and
    re-raises the original exception (via this wrapper's `cause`), as mlx-lm would.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class ForwardFailed(MelixError):
    """A model or head forward of a speculative cycle raised (wraps the cause).

    Only these become speculative faults: an error anywhere else in the engine is a bug
    in this package and propagates as itself (after the caches are put back).
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class SpeculativeFault(MelixError):
    """A speculative cycle failed; caches were restored to the cycle's start."""

    def __init__(self, cause: BaseException, *, drafted: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.drafted = drafted  # the drafts existed (the verify or a later stage failed)


@dataclass
class RowPlan:
    """What one row does in the next step."""

    k: int  # drafts to verify this cycle; 0 = decode plainly
    params: SamplingParams | None  # the distribution its sampler draws from (None: unknown)
    sampler: Sampler | None  # how it draws a plain token (None: greedy argmax)
    processors: tuple = ()
    history: mx.array | None = None  # [n] tokens of its context before y (only with processors)
    remaining: int | None = None  # the fewest tokens the row may still emit (None: no limit)

    @property
    def keep(self) -> int | None:
        """Most drafts the row may keep: one that ends within this cycle keeps no token past
        its end, so its caches hold exactly what it emitted (None: all k)."""
        if self.remaining is None or self.remaining - 1 >= self.k:
            return None
        return max(0, self.remaining - 1)

    @property
    def greedy(self) -> bool:
        return self.sampler is None or (self.params is not None and self.params.greedy)


@dataclass
class RowHead:
    """A row's head state between steps (device arrays are lazy until the next sync)."""

    draft: mx.array | None = None  # [1] the first draft of its next cycle
    q: mx.array | None = None  # [1, V] the distribution that draft came from (sampled rows)
    hidden: mx.array | None = None  # [1, 1, D] head output at the draft's position (chaining)
    pending_h: list[mx.array] = field(default_factory=list)  # [1, D] pairs not yet fed
    pending_t: list[mx.array] = field(default_factory=list)  # [1] their tokens
    # what a sampled row's prompt scored at prime (melix_mlx.runtime.prompt_score), lazy
    prompt_acceptance: mx.array | None = None

    @property
    def fresh(self) -> bool:
        return self.draft is not None and not self.pending_t


@dataclass
class Flight:
    """A launched speculative cycle, not yet synchronised."""

    K: int
    ks: list[int]
    inputs: mx.array  # [B, K + 1] y and drafts
    logprobs: mx.array  # [B, K + 1, V] processed log-probabilities
    accepted: mx.array  # [B] accept counts: drafts the acceptance rule accepted and the row emits
    kept: mx.array  # [B] drafts each row keeps: accepted, capped by RowPlan.keep
    bonus: mx.array  # [B] the token after each row's kept prefix
    next_draft: mx.array  # [B]
    next_q: list[mx.array | None]
    next_hidden: mx.array  # [B, 1, D]
    mark: rollback.CacheMark
    head_mark: rollback.CacheMark
    before: EngineState  # the engine's state at launch: what an undo puts back
    in_graph: bool  # the rollback ran inside the graph; settle only counts its holes
    # what it was launched for (its own, so a driver keeps no run-ahead state beside it)
    plans: list[RowPlan] = field(default_factory=list)
    uids: list[Any] = field(default_factory=list)  # the driver's ids of its rows (default: 0..B-1)


@dataclass
class EngineState:
    """The host-side references an undo restores (the arrays themselves are immutable)."""

    y: mx.array
    rows: list[tuple[Any, ...]]

    @classmethod
    def of(cls, engine: Any) -> EngineState:  # engine: a CycleEngine (typed Any: no import circle)
        rows = [(r.draft, r.q, r.hidden, list(r.pending_h), list(r.pending_t)) for r in engine.rows]
        return cls(engine.y, rows)

    def put_back(self, engine: Any) -> None:
        engine.y = self.y
        for row, saved in zip(engine.rows, self.rows):
            row.draft, row.q, row.hidden, row.pending_h, row.pending_t = saved


@dataclass
class PlainStep:
    """A launched plain step (every row one token), not yet synchronised."""

    tokens: mx.array  # [B]
    logprobs: mx.array  # [B, V]
    mark: rollback.CacheMark | None
    head_mark: rollback.CacheMark | None
    before: EngineState | None  # None: the batch was reshaped since; it can only be settled
    plans: list[RowPlan] = field(default_factory=list)  # what it was launched for, as a Flight
    uids: list[Any] = field(default_factory=list)

    def filtered(self, keep: list[int]) -> PlainStep:
        """The same step for the rows kept by a batch filter (it can no longer be abandoned)."""
        index = mx.array(keep, dtype=mx.int32)
        return PlainStep(
            self.tokens[index],
            self.logprobs[index],
            None,
            None,
            None,
            [self.plans[i] for i in keep] if self.plans else [],
            [self.uids[i] for i in keep] if self.uids else [],
        )


@dataclass
class Settled:
    """A settled cycle: host values per row."""

    accepted: list[int]  # per row: drafts the acceptance rule accepted that the row emits
    tokens: list[list[int]]  # per row: its kept drafts then the bonus token
    logprobs: mx.array  # [B, K + 1, V]
    drafts: list[list[int]]  # per row: the k drafts it proposed (accepted or not)
    kept: list[int]  # per row: drafts its caches keep (accepted, capped by RowPlan.keep)
