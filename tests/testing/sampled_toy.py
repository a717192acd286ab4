"""A pure-Python speculative *sampler* with a correct and a planted biased acceptance rule.

Rules of this file:
- The target `toy_probs(context)` and the draft `toy_draft_probs(context)` (the target
  sharpened, like an over-confident head) are fixed distributions over 8 tokens.
- `SampledToy` has mlx-lm's batch surface. Each row's first token is drawn from the
  target; then every step is one speculative cycle: `k` drafts from the draft
  distribution, each accepted with probability min(1, p/q), the first rejection
  resampled from normalise(max(p - q, 0)), a bonus token from p after k acceptances.
  Its output follows the target exactly.
- `shared_uniform=True` plants the bias a peer shipped: one uniform for all k drafts of
  a cycle instead of one per draft. Acceptances become correlated, which changes the
  distribution from the second draft position on; the first is still right.
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Any

from .toy_generator import Response

VOCAB = 8


def _softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    w = [math.exp(v - top) for v in logits]
    s = sum(w)
    return [x / s for x in w]


def _logits(context: tuple[int, ...] | list[int]) -> list[float]:
    h = sum(context) * 31 + len(context) * 17
    return [((h + 13 * j) % 11) / 3.0 for j in range(VOCAB)]


def toy_probs(context: tuple[int, ...] | list[int]) -> list[float]:
    return _softmax(_logits(context))


def toy_draft_probs(context: tuple[int, ...] | list[int]) -> list[float]:
    # an over-confident head (the target's logits, sharpened): it over-proposes the target's
    # favourite, so drafts are often accepted with probability p / q < 1
    return _softmax([2.0 * v for v in _logits(context)])


def _draw(probs: list[float], rng: random.Random) -> int:
    u, acc = rng.random(), 0.0
    for t, p in enumerate(probs):
        acc += p
        if u < acc:
            return t
    return len(probs) - 1


class SampledToy:
    """See the module rules."""

    def __init__(self, k: int = 2, shared_uniform: bool = False, seed: int = 0) -> None:
        self.k = k
        self.shared_uniform = shared_uniform
        self.rng = random.Random(seed)
        self.queue: deque[tuple[int, list[int], int]] = deque()
        self.rows: list[dict[str, Any]] = []
        self.uid_count = 0

    def insert(self, prompts: list[list[int]], max_tokens: list[int], stop_sequences: list[Any]) -> list[int]:
        uids = []
        for prompt, n in zip(prompts, max_tokens):
            self.queue.append((self.uid_count, list(prompt), n))
            uids.append(self.uid_count)
            self.uid_count += 1
        return uids

    def remove(self, uids: list[int]) -> None:
        wanted = set(uids)
        self.queue = deque(q for q in self.queue if q[0] not in wanted)
        self.rows = [r for r in self.rows if r["uid"] not in wanted]

    def cycle(self, context: list[int]) -> list[int]:
        drafts, qs = [], []
        for _ in range(self.k):
            q = toy_draft_probs(context + drafts)
            qs.append(q)
            drafts.append(_draw(q, self.rng))
        shared = self.rng.random()
        for i, d in enumerate(drafts):
            p = toy_probs(context + drafts[:i])
            u = shared if self.shared_uniform else self.rng.random()
            if u * qs[i][d] >= p[d]:  # rejected: resample from the residual
                residual = [max(a - b, 0.0) for a, b in zip(p, qs[i])]
                total = sum(residual)
                return drafts[:i] + [_draw([r / total for r in residual], self.rng)]
        return drafts + [_draw(toy_probs(context + drafts), self.rng)]

    def next(self) -> tuple[list[Any], list[Response]]:
        out: list[Response] = []
        for row in self.rows:
            self._emit(row, self.cycle(row["context"]), out)
        while self.queue:
            uid, prompt, n = self.queue.popleft()
            row = {"uid": uid, "context": prompt, "left": n}
            self.rows.append(row)
            self._emit(row, [_draw(toy_probs(prompt), self.rng)], out)
        self.rows = [r for r in self.rows if r["left"] > 0]
        return [], out

    def _emit(self, row: dict[str, Any], tokens: list[int], out: list[Response]) -> None:
        for t in tokens[: row["left"]]:
            row["context"] = row["context"] + [t]
            row["left"] -= 1
            out.append(Response(row["uid"], t, "length" if row["left"] == 0 else None))


def toy_probs_batch(contexts: list[tuple[int, ...]]) -> list[list[float]]:
    """The kit's batched probability call for this toy target."""
    return [toy_probs(c) for c in contexts]
