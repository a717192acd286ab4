"""The schedule shrinker: removes operations and requests a failure does not need.

Rules of this module:
- Input: a failing schedule (the driver's JSON-able operations, the failing one last) and
  `fails(schedule) -> bool`, which replays a candidate on a fresh generator and says
  whether it fails with the same bug signature. Output: a schedule that still fails and
  from which no single operation or request can be dropped (a local minimum), within
  `max_replays` replays.
- Hypothesis shrinks the drawn values; this pass shrinks what Hypothesis keeps for the
  stateful machine's sake: operations that change nothing (a remove of a request that
  already ended, a second identical remove, steps after the failure mattered) and
  requests that only came along.
- Passes, repeated until none helps: cut everything after the first failing prefix;
  drop one operation at a time (last first); drop one request at a time from an insert
  (later requests' indices in `remove` operations are renumbered; removes of the dropped
  request go with it); turn a `drain` into a single `next`; shorten one request (half
  or all but one of its prompt, kept from the end; half or one less of its max_tokens):
  the probe schedules (melix_fsm.testing.probes) come unshrunk by Hypothesis.
- Pure core: no mlx, no Hypothesis.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Schedule = list[dict[str, Any]]


def clean(schedule: Sequence[Mapping[str, Any]]) -> Schedule:
    """The schedule without generator-assigned fields (uids): what a replay needs."""
    out = []
    for op in schedule:
        op = {k: copy.deepcopy(v) for k, v in op.items() if k != "uids"}
        out.append(op)
    return out


def shrink_schedule(
    schedule: Sequence[Mapping[str, Any]],
    fails: Callable[[Schedule], bool],
    *,
    max_replays: int = 120,
) -> Schedule:
    """A locally minimal failing schedule (see the module rules)."""
    best = clean(schedule)
    budget = [max_replays]

    def attempt(candidate: Schedule) -> bool:
        if budget[0] <= 0 or not candidate:
            return False
        budget[0] -= 1
        return fails(candidate)

    best = _shortest_prefix(best, attempt)
    progress = True
    while progress and budget[0] > 0:
        progress = False
        for candidate in _without_one_operation(best):
            if attempt(candidate):
                best, progress = candidate, True
                break
        if progress:
            continue
        for candidate in _without_one_request(best):
            if attempt(candidate):
                best, progress = candidate, True
                break
        if progress:
            continue
        for candidate in _drains_as_steps(best):
            if attempt(candidate):
                best, progress = candidate, True
                break
        if progress:
            continue
        for candidate in _shorter_requests(best):
            if attempt(candidate):
                best, progress = candidate, True
                break
    return best


def _shorter_requests(schedule: Schedule) -> list[Schedule]:
    out = []
    for i, op in enumerate(schedule):
        if op["op"] != "insert":
            continue
        for j, request in enumerate(op["requests"]):
            prompt, n = list(request["prompt"]), int(request["max_tokens"])
            shorter = [("prompt", prompt[len(prompt) // 2 :]), ("prompt", prompt[1:])]
            shorter += [("max_tokens", max(1, n // 2)), ("max_tokens", n - 1)]
            seen = set()
            for key, value in shorter:
                size = len(value) if key == "prompt" else value
                if size < 1 or size == (len(prompt) if key == "prompt" else n) or (key, size) in seen:
                    continue
                seen.add((key, size))
                candidate = copy.deepcopy(schedule)
                candidate[i]["requests"][j][key] = value
                out.append(candidate)
    return out


def _shortest_prefix(schedule: Schedule, attempt: Callable[[Schedule], bool]) -> Schedule:
    for end in range(1, len(schedule)):
        if attempt(schedule[:end]):
            return schedule[:end]
    return schedule


def _without_one_operation(schedule: Schedule) -> list[Schedule]:
    out = []
    for i in range(len(schedule) - 1, -1, -1):
        op = schedule[i]
        if op["op"] == "insert":
            continue  # requests go one at a time, with their removes renumbered
        out.append(schedule[:i] + schedule[i + 1 :])
    return out


def _without_one_request(schedule: Schedule) -> list[Schedule]:
    out = []
    index = 0
    for i, op in enumerate(schedule):
        if op["op"] != "insert":
            continue
        for j in range(len(op["requests"])):
            out.append(_drop_request(schedule, i, j, index + j))
        index += len(op["requests"])
    return out


def _drop_request(schedule: Schedule, at: int, position: int, index: int) -> Schedule:
    """Drop request `position` of insert `at` (insertion index `index`); renumber removes."""
    out: Schedule = []
    for i, op in enumerate(schedule):
        op = copy.deepcopy(op)
        if i == at:
            del op["requests"][position]
            if not op["requests"]:
                continue
        elif op["op"] == "remove":
            kept = [r - (r > index) for r in op["requests"] if r != index]
            if not kept:
                continue
            op["requests"] = kept
        out.append(op)
    return out


def _drains_as_steps(schedule: Schedule) -> list[Schedule]:
    return [
        schedule[:i] + [{"op": "next"}] + schedule[i + 1 :]
        for i, op in enumerate(schedule)
        if op["op"] == "drain"
    ]
