"""The step pipeline's machine, compiled from spec/pipeline.toml (melix_fsm.machine).

The cycle engine (melix_mlx.runtime.engine) keeps one `PIPELINE.tracker()` and sends an event for
every change of its queue of launched steps; `IN_FLIGHT` says how many steps each state
holds, so the engine (and the tests) can hold the queue against the machine. No
transition is written here.
"""

from __future__ import annotations

import enum

from .machine import CompiledMachine, Tracker
from .spec import load_machine


class PipelineState(enum.StrEnum):
    """spec/pipeline.toml [states], in the spec's order (checked at import)."""

    idle = "idle"
    in_flight = "in_flight"
    ahead = "ahead"


class PipelineEvent(enum.StrEnum):
    """spec/pipeline.toml [events], in the spec's order (checked at import)."""

    launch = "launch"
    settle = "settle"
    abandon = "abandon"
    fault = "fault"
    extend = "extend"
    filter = "filter"
    clear = "clear"


PIPELINE: CompiledMachine[PipelineState, PipelineEvent] = CompiledMachine(
    load_machine("pipeline"), PipelineState, PipelineEvent, frozenset({"newest"})
)

# Steps in flight in each state: the engine's queue length is a function of the state.
IN_FLIGHT: dict[PipelineState, int] = {
    PipelineState.idle: 0,
    PipelineState.in_flight: 1,
    PipelineState.ahead: 2,
}

PipelineTracker = Tracker[PipelineState, PipelineEvent]
