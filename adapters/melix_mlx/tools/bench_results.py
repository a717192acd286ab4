"""The benchmark's records: one measured cell, a draft-model cell, and the regime a run
measured in (melix_mlx.tools.bench runs the cells; melix_mlx.tools.bench_report renders them).

Plain dataclasses, so a results file is `vars(cell)` per cell and the report is a pure
function of that data.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from melix_fsm.policy.telemetry import loaded_blas, read_proc_maps

from ..runtime.calibrate import device_kind


@dataclass
class Cell:
    """One measured configuration, with its baseline measured beside it."""

    path: str  # "batch" (MTPBatchGenerator vs BatchGenerator) or "single" (vs stream_generate)
    batch_size: int
    k: int
    temp: float
    tps: float = 0.0
    baseline_tps: float = 0.0
    ratio: float = 0.0
    ratio_min: float = 0.0
    ratio_max: float = 0.0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    target_forwards_per_token: float | None = None
    replay_forwards: int = 0
    peak_memory_gb: float = 0.0
    baseline_peak_memory_gb: float = 0.0
    ideal_ratio: float | None = None
    efficiency: float | None = None  # ratio / ideal_ratio
    efficiencies: list[float] = field(default_factory=list)  # per repeat (efficiency: their median)
    # per repeat, with calibrate_each_repeat: the cycle cost its ideal used (None: that
    # calibration failed and the cell's table priced it); empty otherwise
    cycle_costs: list[float | None] = field(default_factory=list)
    batch_fill: float | None = None  # busy rows per verify forward / B (forced on; batch cells)
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # per cycle
    # prompt-phase tokens/s, MTP (forced on) over mlx-lm, median: what the head's pass over
    # each prompt (its prime, prompt work like the prefill) costs before the first token
    prompt_ratio: float | None = None
    auto_tps: float | None = None  # device policy auto (live controller), same cell
    auto_over_plain: float | None = None
    auto_over_force_on: float | None = None
    auto_over_best: float | None = None  # auto / max(plain, force_on), per repeat
    auto_gate: str | None = None
    auto_speculating_share: float | None = None  # steps the auto run speculated
    # the auto runs' policy counters, summed over the repeats (AUTO_COUNTERS): how many
    # first plain probes ran, were put off, or were not because the calibration was doubted,
    # and how many probes the run's end left no room for
    auto_counters: dict[str, int] = field(default_factory=dict)
    auto_depth_over_plain: float | None = None  # depth "auto" (deepest k cell only)
    auto_depth_k: int | None = None  # the depth it settled on
    samples: list[tuple[float, float]] = field(default_factory=list)
    # A/A: the baseline run again at the end of each repeat, over its first run (the noise
    # of this run at the widest spacing of the interleave; empty when not asked for)
    aa_ratios: list[float] = field(default_factory=list)


AUTO_COUNTERS = (
    "plain_probes",
    "plain_probes_deferred",
    "calibration_doubted",
    "suspend_decisions",
    "resume_decisions",
    "probes",
    "probes_skipped_short",
)


@dataclass
class DraftCell:
    """mlx-lm's speculative_generate_step with a draft model, batch 1."""

    k: int
    temp: float
    tps: float = 0.0
    baseline_tps: float = 0.0
    ratio: float = 0.0
    draft_token_share: float | None = None  # emitted tokens that came from the draft model
    refused: str | None = None  # mlx-lm's draft-model path refused this model (its own error)


def regime() -> dict[str, Any]:
    import mlx_lm

    import melix_fsm

    return {
        "device": device_kind(),
        "blas": loaded_blas(read_proc_maps()) if sys.platform.startswith("linux") else "n/a",
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "melix_fsm": melix_fsm.__version__,
    }


def msgspec_builtins(value: Any) -> Any:
    """A msgspec struct as plain data (for the results file)."""
    import msgspec

    return msgspec.to_builtins(value)
