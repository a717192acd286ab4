"""A padded, speculative toy batch generator with the four real-world bug classes plantable.

Rules of this file:
- `PaddedToyGenerator` works the way batched speculative generators do: rows joining in
  one step are prefilled together, left-padded to the longest prompt (the padding is
  masked out); every decode step drafts `k` tokens per row, verifies them, and defers
  the trim of each row's rejected cache slots to the next step through a per-row
  rejection mask; a row's draft state is created at its first decode step; after a
  step it prepares the next one from the first surviving row.
- Its "model" is tests/testing/toy_generator.py's `toy_next` (so `toy_reference` is the
  greedy reference) and its surface is mlx-lm 0.32's (insert / next / remove, no
  `last_report`): the kit checks it in token-only mode, as it would a foreign fork.
- Each flag plants one bug the kit found in a real fork; they change one line each:
  `crash_when_all_finished` (prepares the next step from row 0 even when every row
  left), `crash_on_early_remove` (remove deletes draft state a row only gets at its
  first decode step), `stale_mask_on_extend` (joiners inherit rejection flags instead of
  starting clean), `unmasked_left_padding` (the pad tokens reach the shorter prompts).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from .toy_generator import Response, toy_next

PAD = 0
BUGS = ("crash_when_all_finished", "crash_on_early_remove", "stale_mask_on_extend", "unmasked_left_padding")


@dataclass
class Row:
    uid: int
    cache: list[int]  # tokens whose (toy) KV the row holds
    y: int  # the last emitted token, not fed yet
    max_tokens: int
    stops: list[tuple[int, ...]]
    generated: int = 0
    recent: tuple[int, ...] = ()


class PaddedToyGenerator:
    """See the module rules; every bug flag is off by default (the correct generator)."""

    def __init__(self, k: int = 2, prefill_batch_size: int = 3, **bugs: bool) -> None:
        unknown = set(bugs) - set(BUGS)
        if unknown:
            raise ValueError(f"unknown planted bugs {sorted(unknown)}")
        self.bugs = {name: bool(bugs.get(name)) for name in BUGS}
        self.k = k
        self.prefill_batch_size = prefill_batch_size
        self.rows: list[Row] = []
        self.mask: list[int] = []  # per row: rejected cache slots to trim at the next step
        self.spec: dict[int, int] = {}  # per uid: drafting state, from its first decode step on
        self.queue: deque[tuple[int, list[int], int, list[tuple[int, ...]]]] = deque()
        self.uid_count = 0
        self.ahead: int | None = None

    def insert(self, prompts: list[list[int]], max_tokens: list[int], stop_sequences: list[Any]) -> list[int]:
        uids = []
        for prompt, n, stops in zip(prompts, max_tokens, stop_sequences):
            self.queue.append((self.uid_count, list(prompt), n, [tuple(s) for s in stops]))
            uids.append(self.uid_count)
            self.uid_count += 1
        return uids

    def remove(self, uids: list[int]) -> None:
        wanted = set(uids)
        self.queue = deque(q for q in self.queue if q[0] not in wanted)
        for uid in [r.uid for r in self.rows if r.uid in wanted]:
            if self.bugs["crash_on_early_remove"]:
                del self.spec[uid]
            else:
                self.spec.pop(uid, None)
        self._keep([i for i, r in enumerate(self.rows) if r.uid not in wanted])

    def next(self) -> tuple[list[Any], list[Response]]:
        stepped = bool(self.rows)
        out: list[Response] = []
        done: set[int] = set()
        for i, row in enumerate(self.rows):  # the deferred trim of rejected slots
            if self.mask[i]:
                row.cache = row.cache[: -self.mask[i]]
            self.mask[i] = 0
        for i, row in enumerate(self.rows):
            self.spec.setdefault(row.uid, 0)
            k = self.k
            drafts, context = [], row.cache + [row.y]
            for _ in range(k):
                guess = toy_next(context)
                drafts.append(guess + 1 if len(context) % 3 == 0 else guess)
                context.append(drafts[-1])
            a = 0
            while a < k and drafts[a] == toy_next(row.cache + [row.y] + drafts[:a]):
                a += 1
            bonus = toy_next(row.cache + [row.y] + drafts[:a])
            row.cache = row.cache + [row.y] + drafts  # every fed slot; the rejected ones trim next step
            self.mask[i] = k - a
            row.y = bonus
            self.spec[row.uid] += 1
            if self._emit(row, [*drafts[:a], bonus], out):
                done.add(row.uid)
        self._admit(out, done)
        self._keep([i for i, r in enumerate(self.rows) if r.uid not in done])
        for uid in done:
            self.spec.pop(uid, None)
        if self.bugs["crash_when_all_finished"]:
            if stepped:
                self.ahead = self.rows[0].y
        elif self.rows:
            self.ahead = self.rows[0].y
        return [], out

    def _admit(self, out: list[Response], done: set[int]) -> None:
        joining = [self.queue.popleft() for _ in range(min(self.prefill_batch_size, len(self.queue)))]
        if not joining:
            return
        width = max(len(p) for _, p, _, _ in joining)
        new = []
        for uid, prompt, n, stops in joining:
            padded = [PAD] * (width - len(prompt)) + prompt
            seen = padded if self.bugs["unmasked_left_padding"] else prompt
            row = Row(uid, list(seen), toy_next(seen), n, stops)
            new.append(row)
        self.rows.extend(new)
        if self.bugs["stale_mask_on_extend"]:
            self.mask.extend(self.mask[: len(new)] + [0] * (len(new) - len(self.mask[: len(new)])))
        else:
            self.mask.extend([0] * len(new))
        for row in new:
            if self._emit(row, [], out, first=True):
                done.add(row.uid)

    def _emit(self, row: Row, tokens: list[int], out: list[Response], first: bool = False) -> bool:
        for token in [row.y] if first else tokens:
            row.generated += 1
            row.recent = (row.recent + (token,))[-4:]
            reason = "length" if row.generated >= row.max_tokens else None
            if any(s and row.recent[-len(s) :] == s for s in row.stops):
                reason = "stop"
            out.append(Response(row.uid, token, reason))
            if reason:
                return True
        return False

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.mask = [self.mask[i] for i in keep]


def planted(*bugs: str) -> type[PaddedToyGenerator]:
    """A PaddedToyGenerator class with these bugs planted (a zero-argument factory)."""

    class Planted(PaddedToyGenerator):
        def __init__(self) -> None:
            super().__init__(**{b: True for b in bugs})

    Planted.__name__ = "Planted_" + "_".join(bugs) if bugs else "Correct"
    return Planted
