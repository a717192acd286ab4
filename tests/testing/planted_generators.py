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
- Three more (`CYCLE_BUGS`) plant the classic errors of a speculative cycle:
  `off_by_one_acceptance` (one draft more than matched is accepted), `stale_row_after_filter`
  (after rows leave, each survivor's last token is read at its old row index) and
  `wrong_rollback` (one rejected slot fewer than rejected is trimmed).
- `verify_noise=True` simulates a platform whose verify rounds differently: the verify's
  next token is the argmax of `toy_logits` (whose argmax is `toy_next`) perturbed per
  context, deterministically, by up to half the divergence contract's bound in
  bfloat16 (`NOISE_ULPS` ulps of the largest logit), so only near-ties can flip;
  prefill and drafts are unperturbed. `toy_logits` has a near-tie every fourth context
  length (the runner-up `NEAR_TIE_GAP` below the top) and every other gap at least 1.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from .toy_generator import Response, toy_next

PAD = 0
BUGS = ("crash_when_all_finished", "crash_on_early_remove", "stale_mask_on_extend", "unmasked_left_padding")
CYCLE_BUGS = ("off_by_one_acceptance", "stale_row_after_filter", "wrong_rollback")
VOCAB = 48
TOP, NEAR_TIE_GAP = 10.0, 0.01
NOISE_ULPS = 4.0  # half the contract's default bound (8 ulps): a flip needs a gap under 8 ulps
BF16_EPS = 2.0**-7


def toy_logits(context: list[int] | tuple[int, ...]) -> list[float]:
    """Logits whose argmax is toy_next; a near-tie at every fourth context length."""
    best = toy_next(context)
    spread = sum(context) * 13 + len(context)
    z = [TOP - 1.0 - ((v * 31 + spread) % 17) / 4 for v in range(VOCAB)]
    z[best] = TOP
    if len(context) % 4 == 0:
        z[(best + 2 - 3) % 40 + 3] = TOP - NEAR_TIE_GAP
    return z


def noisy_next(context: list[int] | tuple[int, ...]) -> int:
    """toy_logits' argmax after a deterministic perturbation of NOISE_ULPS bfloat16 ulps."""
    z = toy_logits(context)
    amplitude = NOISE_ULPS * BF16_EPS * max(abs(v) for v in z)
    rng = random.Random(f"verify {list(context)}")  # a str seed: the same on every run
    noisy = [v + rng.uniform(-amplitude, amplitude) for v in z]
    return max(range(VOCAB), key=noisy.__getitem__)


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

    def __init__(
        self, k: int = 2, prefill_batch_size: int = 3, verify_noise: bool = False, **bugs: bool
    ) -> None:
        unknown = set(bugs) - set(BUGS + CYCLE_BUGS)
        if unknown:
            raise ValueError(f"unknown planted bugs {sorted(unknown)}")
        self.bugs = {name: bool(bugs.get(name)) for name in BUGS + CYCLE_BUGS}
        self.verify_next = noisy_next if verify_noise else toy_next
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
            trim = self.mask[i] - (1 if self.bugs["wrong_rollback"] and self.mask[i] else 0)
            if trim:
                row.cache = row.cache[:-trim]
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
            while a < k and drafts[a] == self.verify_next(row.cache + [row.y] + drafts[:a]):
                a += 1
            if self.bugs["off_by_one_acceptance"] and a < k:
                a += 1
            bonus = self.verify_next(row.cache + [row.y] + drafts[:a])
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
        if self.bugs["stale_row_after_filter"] and keep != list(range(len(keep))):
            stale = [self.rows[j].y for j in range(len(keep))]  # read at the old row index
            for i, y in zip(keep, stale):
                self.rows[i].y = y
        self.rows = [self.rows[i] for i in keep]
        self.mask = [self.mask[i] for i in keep]


def planted(*bugs: str, verify_noise: bool = False) -> type[PaddedToyGenerator]:
    """A PaddedToyGenerator class with these bugs planted (a zero-argument factory)."""

    class Planted(PaddedToyGenerator):
        def __init__(self) -> None:
            super().__init__(verify_noise=verify_noise, **{b: True for b in bugs})

    Planted.__name__ = "Planted_" + "_".join(bugs) if bugs else "Correct"
    return Planted
