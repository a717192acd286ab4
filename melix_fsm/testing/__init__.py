"""The conformance kit: the stateful property suite, runnable against any speculative generator.

Rules of this package:
- `import melix_fsm.testing` never imports mlx: the default reference decoder and stop
  builder (`mlx_greedy_reference`, `mlx_stop_sequences`) import mlx-lm inside their
  functions. Hypothesis is needed (the `test` extra).
- The report contract the kit checks is melix_fsm.report (`StepReport`,
  `validate_report`); docs/conformance.md explains each property and how to replay a
  failure.
- Layers: `ReportMirror` (pure: judges StepReports against a shadow Batch), then
  `ConformanceDriver` (runs operations on a generator, checks tokens, records the
  schedule; `replay` re-runs one), then `make_conformance_machine` / `run_conformance`
  (Hypothesis draws the operations and shrinks failures).
"""

from .driver import ConformanceDriver, RequestSpec, replay
from .machine import PROFILES, make_conformance_machine, profile_settings, run_conformance
from .mirror import PROPERTIES, ConformanceError, ReportMirror, allowed_emissions
from .reference import cut_at_stop, memoized, mlx_greedy_reference, mlx_stop_sequences

__all__ = [
    "PROFILES",
    "PROPERTIES",
    "ConformanceDriver",
    "ConformanceError",
    "ReportMirror",
    "RequestSpec",
    "allowed_emissions",
    "cut_at_stop",
    "make_conformance_machine",
    "memoized",
    "mlx_greedy_reference",
    "mlx_stop_sequences",
    "profile_settings",
    "replay",
    "run_conformance",
]
