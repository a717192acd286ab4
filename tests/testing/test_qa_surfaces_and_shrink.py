"""Generator surfaces (0.32 batch, 0.31 state machines, single-sequence streams) and the shrinker.

Rules of this file:
- Each surface adapter runs the whole kit on a correct toy behind that surface and must
  pass; a wrong shape is a `SurfaceError` naming what is missing, never a guess.
- The shrinker is tested with a deterministic failure predicate: it must remove every
  operation and request the failure does not need, renumber removes, and stop at a
  local minimum.
- No mlx.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings

from melix_fsm.testing import PROFILES, run_conformance
from melix_fsm.testing.shrink import shrink_schedule
from melix_fsm.testing.surfaces import SurfaceError, as_surface, surface_kind

from .toy_generator import ToyGenerator, toy_next, toy_reference, toy_stops

TOY = {"tokens": (3, 12), "prompt_lengths": (1, 4), "max_tokens": (1, 8)}
QUICK = settings(PROFILES["quick"], max_examples=25)


class OldStyleToy(ToyGenerator):
    """The 0.31 surface: stop sequences travel as state machines (here: a list of tuples)."""

    def insert(self, prompts: list[list[int]], max_tokens: list[int], state_machines: list[Any]) -> list[int]:
        return super().insert(prompts, max_tokens, [machine["stops"] for machine in state_machines])


def old_style_machine(stops: Any) -> dict[str, Any]:
    return {"stops": [tuple(s) for s in stops]}


def toy_stream(prompt: list[int], max_tokens: int) -> Any:
    """A stream_generate-like callable: yields (token, logprobs) pairs."""
    context = list(prompt)
    for _ in range(max_tokens):
        token = toy_next(context)
        context.append(token)
        yield token, None


def test_surface_detection() -> None:
    assert surface_kind(ToyGenerator()) == "batch"
    assert surface_kind(OldStyleToy()) == "state-machines"
    assert surface_kind(toy_stream) == "stream"

    class NoStops:
        def insert(self, prompts: list) -> list:
            return []

        def next(self) -> Any:
            return [], []

    with pytest.raises(SurfaceError, match="neither stop_sequences"):
        surface_kind(NoStops())
    with pytest.raises(SurfaceError, match="no generator surface"):
        as_surface(42)
    with pytest.raises(SurfaceError, match="unknown surface"):
        as_surface(ToyGenerator(), "sideways")


def test_state_machine_surface_passes_the_kit() -> None:
    run_conformance(OldStyleToy, toy_reference, make_stops=old_style_machine, settings=QUICK, **TOY)


def test_stream_surface_passes_the_kit() -> None:
    run_conformance(lambda: toy_stream, toy_reference, settings=QUICK, **TOY)


def test_stream_surface_catches_an_early_end() -> None:
    from melix_fsm.testing import ConformanceError, replay

    def short(prompt: list[int], max_tokens: int) -> Any:
        yield from list(toy_stream(prompt, max_tokens))[:1]

    schedule = [{"op": "insert", "requests": [{"prompt": [3, 4], "max_tokens": 3}]}, {"op": "drain"}]
    with pytest.raises(ConformanceError) as info:
        replay(schedule, lambda: short, toy_reference)
    assert info.value.prop == "tokens_match_reference" and "finished with tokens" in str(info.value)
    replay(schedule, lambda: toy_stream, toy_reference)


def _needs(schedule: list[dict[str, Any]]) -> bool:
    """Fails when a request with prompt [7] was inserted and later removed, then a step ran."""
    index, target, removed = 0, None, False
    for op in schedule:
        if op["op"] == "insert":
            for r in op["requests"]:
                if r["prompt"] == [7]:
                    target = index
                index += 1
        elif op["op"] == "remove" and target in op["requests"]:
            removed = True
        elif op["op"] in ("next", "drain") and removed:
            return True
    return False


def test_shrinker_drops_what_the_failure_does_not_need() -> None:
    r = lambda p: {"prompt": p, "max_tokens": 2, "stops": [], "options": {}}  # noqa: E731
    schedule = [
        {"op": "insert", "requests": [r([1]), r([2])], "uids": [0, 1]},
        {"op": "next"},
        {"op": "insert", "requests": [r([3]), r([7])], "uids": [2, 3]},
        {"op": "remove", "requests": [0], "uids": [0]},
        {"op": "remove", "requests": [3], "uids": [3]},
        {"op": "remove", "requests": [3], "uids": []},
        {"op": "remove", "requests": [3], "uids": []},
        {"op": "next"},
        {"op": "drain"},
    ]
    assert _needs(schedule)
    calls = []

    def fails(candidate: list[dict[str, Any]]) -> bool:
        calls.append(candidate)
        return _needs(candidate)

    small = shrink_schedule(schedule, fails)
    assert small == [  # the last pass also shortened the one request's budget
        {"op": "insert", "requests": [{**r([7]), "max_tokens": 1}]},
        {"op": "remove", "requests": [0]},
        {"op": "next"},
    ]
    assert len(calls) < 60


class ListNextToy(ToyGenerator):
    """Older generators' `next()`: a plain list of generation responses."""

    def next(self) -> Any:  # type: ignore[override]
        return super().next()[1]


def test_a_plain_list_from_next_is_read_as_generation_responses() -> None:
    run_conformance(ListNextToy, toy_reference, make_stops=toy_stops, settings=QUICK, **TOY)


def test_no_stop_object_for_an_insert_without_stops() -> None:
    """A stop-less call passes no stop keyword (0.31.3 rejects SequenceStateMachine(None));
    in a call with stops, a stop-less request gets the builder's empty form."""
    from melix_fsm.testing.driver import RequestSpec
    from melix_fsm.testing.surfaces import BatchSurface, StateMachineSurface

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[dict[str, Any]] = []

        def insert(self, prompts: list[list[int]], max_tokens: Any = None, **kwargs: Any) -> list[int]:
            self.calls.append(kwargs)
            return list(range(len(self.calls) * 10, len(self.calls) * 10 + len(prompts)))

        def next(self) -> Any:
            return [], []

    built: list[list[Any]] = []

    def builder(stops: Any) -> str:
        built.append(list(stops))
        return f"stops{len(built)}"

    for surface_class, keyword in ((BatchSurface, "stop_sequences"), (StateMachineSurface, "state_machines")):
        gen, built[:] = Recorder(), []
        surface = surface_class(gen, builder)
        surface.insert([RequestSpec((3,), 2), RequestSpec((4, 5), 1)])
        surface.insert([RequestSpec((3,), 2, ((7,),)), RequestSpec((4,), 1)])
        assert gen.calls[0] == {} and gen.calls[1] == {keyword: ["stops1", "stops2"]}
        assert built == [[(7,)], []]
