"""melix-fsm: the speculative-decoding lifecycle as state machines (sans-IO core, no mlx).

The spec files in spec/ are the truth; this package compiles them into a table-driven
runtime (`SequenceMachine`, `Batch`), an oracle, diagrams and invariant checkers.
mlx-lm glue lives in the separate `melix_mlx` package.
"""

from .batch import Batch, Row
from .counters import Counters
from .errors import (
    BatchShapeError,
    DuplicateSequence,
    IllegalTransition,
    InvalidEvent,
    LifecycleError,
    MelixError,
    SpecError,
    UnknownSequence,
)
from .lifecycle import TABLE, Event, SequenceMachine, Signal, State

__version__ = "0.1.0"

__all__ = [
    "TABLE",
    "Batch",
    "BatchShapeError",
    "Counters",
    "DuplicateSequence",
    "Event",
    "IllegalTransition",
    "InvalidEvent",
    "LifecycleError",
    "MelixError",
    "Row",
    "SequenceMachine",
    "Signal",
    "SpecError",
    "State",
    "UnknownSequence",
]
