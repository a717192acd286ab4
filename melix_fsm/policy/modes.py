"""The live controller's modes, compiled from spec/controller.toml (melix_fsm.machine).

The controller (melix_fsm.policy.controller) changes mode only by sending these events
through its tracker; what each guard means numerically stays in the controller. This
module adds the one fact the table does not hold: which modes draft.
"""

from __future__ import annotations

import enum

from ..machine import CompiledMachine
from ..spec import load_machine


class Mode(enum.StrEnum):
    """spec/controller.toml [states], in the spec's order (checked at import)."""

    configured = "configured"
    disabled = "disabled"
    force_on = "force_on"
    force_off = "force_off"
    on = "on"
    plain_probe = "plain_probe"
    suspended = "suspended"
    spec_probe = "spec_probe"


class ModeEvent(enum.StrEnum):
    """spec/controller.toml [events], in the spec's order (checked at import)."""

    disable = "disable"
    pin_on = "pin_on"
    pin_off = "pin_off"
    resolve = "resolve"
    reprice = "reprice"
    defer_plain_probe = "defer_plain_probe"
    start_plain_probe = "start_plain_probe"
    end_plain_probe = "end_plain_probe"
    suspend = "suspend"
    start_spec_probe = "start_spec_probe"
    end_spec_probe = "end_spec_probe"
    resume = "resume"


# The guards the spec names; their meaning is the controller's (melix_fsm.policy.controller).
GUARDS = frozenset({"prior_admits", "prompts_admit", "speculation_holds", "probe_passed"})

CONTROLLER: CompiledMachine[Mode, ModeEvent] = CompiledMachine(
    load_machine("controller"), Mode, ModeEvent, GUARDS
)

# The modes whose next step drafts (the spec's `doc` says so; checked by tests against it).
SPECULATING: frozenset[Mode] = frozenset({Mode.force_on, Mode.on, Mode.spec_probe})
# The modes on the speculating side of auto's verdict: a plain probe is a window inside
# it. A switch of side starts the minimum dwell and ends depth exploration.
ON_SIDE: frozenset[Mode] = frozenset({Mode.on, Mode.plain_probe})
PROBES: frozenset[Mode] = frozenset({Mode.plain_probe, Mode.spec_probe})
