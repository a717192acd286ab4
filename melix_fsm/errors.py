"""The one error tree of melix-fsm.

Every error the package raises on purpose derives from `MelixError`, so a caller
can catch the whole family with one clause and anything else is a bug.

    MelixError
    ├── SpecError              a spec file is malformed (names the offending entry)
    ├── ConfigError            a speculative setting or profile is unusable (usage error)
    ├── CheckpointError        a checkpoint directory cannot be read (names file and problem)
    └── LifecycleError         a lifecycle or batch operation was refused
        ├── IllegalTransition  (sequence, state, event) has no row in the table
        ├── InvalidEvent       the event is legal here but its payload is not
        ├── UnknownSequence    the uid is not in the batch (never was, or left)
        ├── DuplicateSequence  the uid is already in the batch
        ├── EventNotInOperation  a batch operation got an event spec/batch.toml does not list for it
        └── BatchShapeError    a filter/extend request that would reorder or lose rows

Defined beside the code that raises them, in the same tree: `PolicyError` >
`CalibrationError(reason)` (melix_fsm.policy.errors), `InvariantViolation`
(melix_fsm.invariants), `InvalidReport` (melix_fsm.report), `ConformanceError(prop)`
(melix_fsm.testing; also an AssertionError so test runners report it as a failure), and
in the mlx glue `HeadLoadError(reason: RefusalReason)` > `MissingHeadWeights` /
`HeadShapeMismatch` / `UnsupportedModel` (melix_mlx.loading.errors).

State on error (as h11 does it): a refused event leaves the machine, and a refused
batch operation leaves every row, exactly as it was.
"""

from __future__ import annotations

from typing import Any


class MelixError(Exception):
    """Base class of every error melix-fsm raises on purpose."""


class SpecError(MelixError):
    """A spec file is malformed; the message names the offending entry."""

    def __init__(self, path: str, entry: str, problem: str) -> None:
        self.path = path
        self.entry = entry
        self.problem = problem
        super().__init__(f"{path}: {entry}: {problem}")


class ConfigError(MelixError):
    """A speculative setting (flag, keyword argument or profile entry) is unusable."""

    def __init__(self, setting: str, problem: str) -> None:
        self.setting = setting
        self.problem = problem
        super().__init__(f"{setting}: {problem}")


class CheckpointError(MelixError):
    """A checkpoint file cannot be read or parsed; nothing was loaded.

    `path` names the file (or directory), `problem` says what is wrong with it.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class LifecycleError(MelixError):
    """A lifecycle or batch operation was refused; nothing changed."""


class IllegalTransition(LifecycleError):
    """The (state, event) pair has no transition in the lifecycle table."""

    def __init__(self, sequence: Any, state: Any, event: Any) -> None:
        self.sequence = sequence
        self.state = state
        self.event = event
        super().__init__(
            f"sequence {sequence!r}: event {_name(event)!r} is illegal in state {_name(state)!r}"
        )


class InvalidEvent(LifecycleError):
    """The event is legal in this state but its payload is not (e.g. zero drafts)."""

    def __init__(self, sequence: Any, event: Any, detail: str) -> None:
        self.sequence = sequence
        self.event = event
        self.detail = detail
        super().__init__(f"sequence {sequence!r}: event {_name(event)!r}: {detail}")


class UnknownSequence(LifecycleError, KeyError):
    """The uid is not in the batch: it never joined, or it was filtered out."""

    def __init__(self, uid: Any) -> None:
        self.uid = uid
        super().__init__(uid)

    def __str__(self) -> str:  # KeyError would quote the repr only
        return f"sequence {self.uid!r} is not in the batch"


class DuplicateSequence(LifecycleError):
    """The uid is already in the batch."""

    def __init__(self, uid: Any) -> None:
        self.uid = uid
        super().__init__(f"sequence {uid!r} is already in the batch")


class EventNotInOperation(LifecycleError):
    """A batch operation was given an event that spec/batch.toml does not list for it."""

    def __init__(self, operation: str, sequence: Any, event: Any, allowed: tuple[str, ...]) -> None:
        self.operation = operation
        self.sequence = sequence
        self.event = event
        self.allowed = allowed
        super().__init__(
            f"batch operation {operation!r}: sequence {sequence!r}: event {_name(event)!r} "
            f"is not one of its events {list(allowed)}"
        )


class BatchShapeError(LifecycleError):
    """A reshaping request would reorder, duplicate or invent rows."""


def _name(value: Any) -> str:
    return getattr(value, "value", value)
