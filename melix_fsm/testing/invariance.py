"""Batch-invariance oracles: a row's tokens do not depend on its neighbours.

Rules of this module:
- The oracle of a prompt is the generator's own greedy output for it decoded alone
  (`alone_reference`: one request in a fresh generator, stepped until it ends,
  memoized). Every case below must reproduce it for every request it holds, the
  neighbours included (each against its own alone run):
  `position i of B` (the prompt at each row of one insert beside the same neighbours),
  `other neighbours` (the prompt beside a second set) and `joins running batch` (the
  neighbours take 1, then 3 steps first, then the prompt joins them: rows at other
  offsets, after accepted and rejected drafts).
- The cases are ordinary driver schedules (melix_fsm.testing.driver), so every other
  property is checked on the way and a failing case replays with `replay` against
  `alone_reference`. A difference is judged by the divergence contract when a judge is
  given (melix_fsm.testing.divergence: near-ties counted, anything else a bug);
  without one any difference is a bug (bit-exact, what the platform gives on a CPU).
- `CaseResult` is plain data: the case, its schedule, the error (None when it held) and
  the near-ties it met. Pure core: no mlx, no Hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .divergence import Divergence, DivergenceJudge
from .driver import ConformanceDriver, RequestSpec, StopBuilder
from .mirror import ConformanceError
from .reference import Reference, memoized
from .surfaces import as_surface

JOIN_AFTER = (1, 3)  # steps the neighbours take before the prompt joins them (one case each)


def alone_reference(
    make_generator: Callable[[], Any],
    *,
    options: Mapping[str, Any] | None = None,
    make_stops: StopBuilder | None = None,
    surface: str = "auto",
    max_steps: int = 4096,
) -> Reference:
    """The generator's own tokens for a prompt decoded alone (the oracle), memoized."""

    def alone(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        s = as_surface(make_generator(), surface, make_stops)
        (uid,) = s.insert([RequestSpec(tuple(prompt), max_tokens, (), dict(options or {}))])
        got: list[int] = []
        for _ in range(max_steps):
            done = False
            for e in s.step():
                if e.uid == uid:
                    got.append(e.token)
                    done = done or e.finish_reason is not None
            if done:
                return tuple(got)
        raise RuntimeError(f"a lone request did not finish in {max_steps} steps")

    return memoized(alone)


@dataclass
class CaseResult:
    name: str
    schedule: list[dict[str, Any]]
    error: ConformanceError | None = None
    near_ties: list[Divergence] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "FAIL"
        return "within contract" if self.near_ties else "bit-exact"

    def as_dict(self) -> dict[str, Any]:
        return {
            "case": self.name,
            "verdict": self.verdict,
            "near_ties": [d.as_dict() for d in self.near_ties],
            "error": str(self.error.detail) if self.error is not None else None,
            "schedule": self.schedule,
        }


def _request(prompt: Sequence[int], n: int, options: Mapping[str, Any]) -> dict[str, Any]:
    return RequestSpec(tuple(prompt), n, (), dict(options)).as_dict()


def invariance_cases(
    prompt: Sequence[int],
    neighbours: Sequence[Sequence[int]],
    others: Sequence[Sequence[int]],
    max_tokens: int,
    options: Mapping[str, Any] | None = None,
) -> list[tuple[str, list[dict[str, Any]]]]:
    """The cases' schedules: each position beside `neighbours`, beside `others`, joining."""
    options = dict(options or {})
    cases = []
    for i in range(len(neighbours) + 1):
        row = [list(p) for p in neighbours]
        row.insert(i, list(prompt))
        insert = {"op": "insert", "requests": [_request(p, max_tokens, options) for p in row]}
        cases.append((f"position {i} of {len(row)}", [insert, {"op": "drain"}]))
    beside = [list(others[0]), list(prompt), *[list(p) for p in others[1:]]]
    insert = {"op": "insert", "requests": [_request(p, max_tokens, options) for p in beside]}
    cases.append(("other neighbours", [insert, {"op": "drain"}]))
    first = {"op": "insert", "requests": [_request(p, max_tokens, options) for p in neighbours]}
    joining = {"op": "insert", "requests": [_request(prompt, max_tokens, options)]}
    for steps in JOIN_AFTER:
        name = f"joins running batch after {steps} step(s)"
        cases.append((name, [first, *[{"op": "next"}] * steps, joining, {"op": "drain"}]))
    return cases


def check_batch_invariance(
    make_generator: Callable[[], Any],
    prompt: Sequence[int],
    neighbours: Sequence[Sequence[int]],
    others: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    judge: DivergenceJudge | None = None,
    options: Mapping[str, Any] | None = None,
    make_stops: StopBuilder | None = None,
    surface: str = "auto",
    oracle: Reference | None = None,
    progress: Callable[[str, Any], None] | None = None,
) -> list[CaseResult]:
    """Run every case against the alone runs; one result per case (module rules)."""
    oracle = oracle or alone_reference(
        make_generator, options=options, make_stops=make_stops, surface=surface
    )
    results = []
    for name, schedule in invariance_cases(prompt, neighbours, others, max_tokens, options):
        if progress is not None:
            progress("invariance", name)
        driver = ConformanceDriver(
            make_generator(), oracle, make_stops=make_stops, surface=surface, judge=judge
        )
        result = CaseResult(name, schedule)
        try:
            driver.run(schedule)
        except ConformanceError as err:
            result.error = err
        result.near_ties = [t.divergence for t in driver.requests if t.divergence is not None]
        results.append(result)
    return results


__all__ = ["JOIN_AFTER", "CaseResult", "alone_reference", "check_batch_invariance", "invariance_cases"]
