"""Probe schedules: fixed shapes that reach every known bug class, whatever the seed.

Rules of this module:
- A random search finds a bug only when it happens to draw its shape; the shapes that
  broke real batched generators are few and known, so every hunt runs them first:
  single-token budgets (every row finishing at once), a removal before the request's
  first step (still queued, or still in prefill), ragged prompts inserted in one call
  (left-padded prefill), a join into a batch that has been decoding for a few steps
  (speculative rows then sit at different offsets after rejections), and rows finishing
  while others continue (a reshape of per-row state).
- The seed picks only the prompt tokens, never the shapes, so each shape runs on every
  seed. Each probe runs greedy (tokens checked against the reference) and, when a
  sampled generator is given, sampled (a `{"op": "sampling", "temperature": T}` marker
  first; everything but the token values checked): some bugs live only on the sampled
  path.
- `options` gives fixed values for extra insert keywords (request i of a probe gets
  item i % n of each list), e.g. draft counts, so probes stay plain JSON.
- Pure core: no mlx, no Hypothesis.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

Schedule = list[dict[str, Any]]

# (name, operations): an insert is a list of (prompt length, max_tokens); "next" one step;
# ("remove", i) removes request i (insertion order); "drain" steps until all ended
SHAPES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("one request, one token", ([(3, 1)], "drain")),
    ("two requests, one token each", ([(2, 1), (5, 1)], "drain")),
    ("all rows finish together", ([(3, 2), (3, 2)], "drain", [(4, 1)], "drain")),
    ("ragged prompts in one insert", ([(1, 6), (7, 6), (4, 6)], "drain")),
    ("ragged pair, long budgets", ([(2, 8), (8, 8)], "drain")),
    ("remove a queued request", ([(3, 4), (5, 4), (2, 4), (6, 4)], ("remove", 3), "drain")),
    ("remove before the first step", ([(3, 5), (4, 5)], ("remove", 1), "next", "drain")),
    ("remove the only request at once", ([(4, 5)], ("remove", 0), [(3, 3)], "drain")),
    ("remove right after the join", ([(3, 5), (4, 5)], "next", ("remove", 1), "drain")),
    ("remove a joiner before its first token", ([(3, 6)], "next", "next", [(5, 4)], ("remove", 1), "drain")),
    (
        "join a decoding batch",
        ([(4, 8)], "next", "next", "next", [(2, 6)], "next", [(5, 4), (3, 5)], "drain"),
    ),
    ("join after a removal", ([(3, 8), (6, 8)], "next", "next", ("remove", 0), [(4, 3)], "drain")),
    ("finish while others continue", ([(3, 2), (3, 7), (5, 5)], "drain")),
    ("staggered budgets, late join", ([(2, 1), (6, 3)], "next", [(3, 6)], "next", "next", "drain")),
)


def probe_schedules(
    seed: int,
    *,
    tokens: tuple[int, int] = (3, 255),
    options: Mapping[str, Sequence[Any]] | None = None,
    temperature: float | None = None,
) -> list[tuple[str, Schedule]]:
    """Every probe shape with the seed's prompt tokens; sampled copies when `temperature` > 0."""
    rng = random.Random(seed)
    greedy = [(name, _build(ops, rng, tokens, options or {})) for name, ops in SHAPES]
    out = list(greedy)
    if temperature is not None and temperature > 0:
        marker = {"op": "sampling", "temperature": float(temperature)}
        out += [(f"{name} (sampled)", [dict(marker), *ops]) for name, ops in greedy]
    return out


def _build(
    ops: tuple[Any, ...], rng: random.Random, tokens: tuple[int, int], options: Mapping[str, Sequence[Any]]
) -> Schedule:
    schedule: Schedule = []
    count = 0
    for op in ops:
        if op == "next" or op == "drain":
            schedule.append({"op": op})
        elif isinstance(op, tuple):
            schedule.append({"op": "remove", "requests": [op[1]]})
        else:
            requests = []
            for length, max_tokens in op:
                extra = {k: v[count % len(v)] for k, v in options.items() if v}
                prompt = [rng.randint(*tokens) for _ in range(length)]
                requests.append({"prompt": prompt, "max_tokens": max_tokens, "stops": [], "options": extra})
                count += 1
            schedule.append({"op": "insert", "requests": requests})
    return schedule


def is_sampled(schedule: Sequence[Mapping[str, Any]]) -> float | None:
    """The temperature of a sampled schedule (its leading marker), else None."""
    if schedule and schedule[0].get("op") == "sampling":
        return float(schedule[0]["temperature"])
    return None
