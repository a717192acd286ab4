"""A pure-Python speculative batch generator implementing the report contract (no mlx).

Rules of this file:
- The "model" is a deterministic function of the context (`toy_next`); `toy_reference`
  is its greedy decoding, the reference the kit compares with. The "head" guesses the
  token after next right except when the context length is a multiple of 3, so cycles
  fully accept, partially accept and roll back.
- `ToyGenerator` has BatchGenerator's surface (insert / next / remove) and reports every
  step through `last_report`, keeping its rows in a melix_fsm Batch. `prefill_batch_size`
  rows join per step, after the decode step, as MTPBatchGenerator does.
- It lets the kit's own tests run the whole Hypothesis machine in milliseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from melix_fsm import lifecycle as lc
from melix_fsm.batch import Batch
from melix_fsm.counters import Counters
from melix_fsm.report import RowReport, StepReport


def toy_next(context: list[int] | tuple[int, ...]) -> int:
    return (sum(context) * 7 + len(context)) % 40 + 3


def toy_reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    context, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(toy_next(context))
        context.append(out[-1])
    return tuple(out)


@dataclass
class Response:
    uid: int
    token: int
    finish_reason: str | None


@dataclass
class ToyRow:
    context: list[int]
    max_tokens: int
    stops: list[tuple[int, ...]]
    generated: list[int] = field(default_factory=list)


class ToyGenerator:
    """See the module rules; `k` drafts per cycle."""

    def __init__(self, k: int = 2, prefill_batch_size: int = 2) -> None:
        self.k = k
        self.prefill_batch_size = prefill_batch_size
        self.batch = Batch()
        self.queue: deque[tuple[int, ToyRow]] = deque()
        self.next_uid = 0
        self.last_report = StepReport()

    def insert(self, prompts: list[list[int]], max_tokens: list[int], stop_sequences: list[Any]) -> list[int]:
        uids = []
        for prompt, n, stops in zip(prompts, max_tokens, stop_sequences):
            self.queue.append((self.next_uid, ToyRow(list(prompt), n, [tuple(s) for s in stops])))
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def remove(self, uids: list[int]) -> None:
        wanted = set(uids)
        self.queue = deque(item for item in self.queue if item[0] not in wanted)
        leaving = [uid for uid in self.batch.uids if uid in wanted]
        self.batch.finish(leaving)
        self.batch.filter_uids([uid for uid in self.batch.uids if uid not in wanted])

    def guess(self, context: list[int]) -> int:
        right = toy_next(context)
        return right + 1 if len(context) % 3 == 0 else right

    def next(self) -> tuple[list[Any], list[Response]]:
        stepped = self.batch.uids
        events: dict[int, list[lc.Signal]] = {uid: [] for uid in stepped}
        emitted: dict[int, list[int]] = {}
        out: list[Response] = []
        done: list[int] = []
        for row in self.batch.rows:
            state: ToyRow = row.payload
            k = max(1, min(self.k, state.max_tokens - len(state.generated) - 1))
            drafts, context = [], list(state.context)
            for _ in range(k):
                drafts.append(self.guess(context))
                context.append(drafts[-1])
            a = 0
            while a < k and drafts[a] == toy_next(state.context + drafts[:a]):
                a += 1
            bonus = toy_next(state.context + drafts[:a])
            signals = [lc.draft(k), lc.VERIFY, lc.verified(a)]
            row.machine.send(signals[0])
            row.machine.send(signals[1])
            row.machine.send(signals[2])
            events[row.uid].extend(signals)
            if self.emit(row.uid, state, [*drafts[:a], bonus], emitted, out):
                done.append(row.uid)
        joined = []
        for _ in range(min(self.prefill_batch_size, len(self.queue))):
            uid, state = self.queue.popleft()
            self.batch.extend([uid], payloads=[state])
            self.batch.send(uid, lc.ADMIT)
            events[uid] = [lc.ADMIT]
            joined.append(uid)
            if self.emit(uid, state, [toy_next(state.context)], emitted, out):
                done.append(uid)
        for uid in done:
            self.batch.send(uid, lc.FINISH)
            events[uid].append(lc.FINISH)
        rows = [
            RowReport(uid=uid, events=events[uid], emitted=emitted.get(uid, []), counters=self.counters(uid))
            for uid in stepped + joined
        ]
        self.batch.filter_uids([uid for uid in self.batch.uids if uid not in set(done)])
        self.last_report = StepReport(rows=rows, joined=joined, left=done, order=self.batch.uids)
        return [], out

    def counters(self, uid: int) -> Counters:
        c = Counters()  # a copy: the report must not change when the row does later
        c.add(self.batch.row(uid).counters)
        return c

    def emit(self, uid: int, state: ToyRow, tokens: list[int], emitted: dict, out: list) -> bool:
        for token in tokens:
            state.generated.append(token)
            state.context.append(token)
            emitted.setdefault(uid, []).append(token)
            reason = "length" if len(state.generated) >= state.max_tokens else None
            if any(s and tuple(state.generated[-len(s) :]) == s for s in state.stops):
                reason = "stop"
            out.append(Response(uid, token, reason))
            if reason:
                return True
        return False


class ToyMixesRows(ToyGenerator):
    """After a step, row 0 continues from row 1's context (per-row state mixed up)."""

    def next(self) -> tuple[list[Any], list[Response]]:
        result = super().next()
        rows = self.batch.rows
        if len(rows) > 1 and len(rows[0].payload.context) != len(rows[1].payload.context):
            rows[0].payload.context = list(rows[1].payload.context)
        return result


def toy_stops(stops: Any) -> list[tuple[int, ...]]:
    """The toy's stop-sequence builder (the kit's default builds mlx-lm StopSequences)."""
    return [tuple(s) for s in stops]
