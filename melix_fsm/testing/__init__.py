"""The conformance kit: the stateful property suite, runnable against any speculative generator.

Rules of this package:
- `import melix_fsm.testing` never imports mlx: the default reference decoder and stop
  builder (`mlx_greedy_reference`, `mlx_stop_sequences`) import mlx-lm inside their
  functions. Hypothesis is needed (the `test` extra).
- The report contract the kit checks is melix_fsm.report (`StepReport`,
  `validate_report`); docs/conformance.md explains each property and how to replay a
  failure.
- Layers: `surfaces` (the calls made on each generator shape), `ReportMirror` (pure:
  judges StepReports against a shadow Batch), then `ConformanceDriver` (runs operations
  on a generator, checks tokens, records the schedule; `replay` re-runs one), then
  `make_conformance_machine` / `run_conformance` (Hypothesis draws the operations and
  shrinks failures). On top: `hunt_bugs` (every distinct bug of a run, by `signature`,
  shrunk further by `shrink`, after the fixed `probes`), `distribution` (sampled
  decoding against the target's probabilities) and `qa` (the session and report behind
  `melix-fsm qa`). Beside them: `divergence` (the contract that tells a rounding-level
  near-tie from a bug, by the reference's logits) and `invariance` (batch-invariance
  oracles: a row's tokens do not depend on its neighbours).
"""

from .distribution import check_distribution, draw_continuations, draw_with_restarts, measure_distribution
from .divergence import DivergenceJudge, DivergenceLedger, RoundingContract, judge_for
from .driver import ConformanceDriver, RequestSpec, replay
from .hunt import Bug, HuntResult, group_causes, hunt_bugs
from .invariance import alone_reference, check_batch_invariance
from .machine import PROFILES, make_conformance_machine, profile_settings, run_conformance
from .mirror import PROPERTIES, ConformanceError, ReportMirror, allowed_emissions
from .probes import probe_schedules
from .reference import cut_at_stop, memoized, mlx_greedy_reference, mlx_stop_sequences
from .shrink import shrink_schedule
from .signature import Signature, signature_of
from .surfaces import SurfaceError, as_surface

__all__ = [
    "PROFILES",
    "PROPERTIES",
    "Bug",
    "DivergenceJudge",
    "DivergenceLedger",
    "RoundingContract",
    "alone_reference",
    "check_batch_invariance",
    "judge_for",
    "HuntResult",
    "Signature",
    "SurfaceError",
    "as_surface",
    "check_distribution",
    "draw_continuations",
    "draw_with_restarts",
    "group_causes",
    "measure_distribution",
    "probe_schedules",
    "hunt_bugs",
    "shrink_schedule",
    "signature_of",
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
