"""The benchmark harness: MTP against mlx-lm's own decode paths, side by side in one run.

Rules of this module:
- Every figure is a ratio of two measurements taken in the same process, interleaved
  (baseline, candidate, baseline, candidate, ...) and summarised by the median, so slow
  drift of a shared machine hits both sides alike. Absolute tokens/s are reported too,
  but only the ratios are claims.
- Baselines: mlx-lm's `BatchGenerator` at the same batch size (every cell), mlx-lm's plain
  `stream_generate` and its `speculative_generate_step` with a draft model (batch 1).
- Each batch cell runs three generators side by side: plain (mlx-lm), MTP forced on, and MTP
  under the device policy's `auto` (the calibrated controller `generate` would use).
- Throughput is generation tokens over generation time, prompt processing excluded, read
  from each generator's own counters (mlx-lm's `BatchStats` for both batch generators,
  `generation_tps` of the last response for the single-sequence paths).
- Each MTP cell also reports what the cost model predicted from the calibrated timings and
  the acceptance it measured, so measured / predicted shows how much the implementation
  leaves on the table.
- The regime (device, BLAS loaded into this process, dtype, versions) is recorded with
  the results: the same machine gives opposite verdicts in different regimes.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from melix_fsm.policy import (
    ActivationController,
    Policy,
    TimingTable,
    acceptance_prior,
    decide,
    expected_tokens_from_positions,
)
from melix_fsm.telemetry import loaded_blas, read_proc_maps

from .batch_generator import MTPBatchGenerator
from .calibrate import calibrate, device_kind, model_dtype
from .generate import mtp_stream_generate
from .sampling import make_sampler

BENCH_PROMPTS = [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Cache:\n    def __init__(self, maxsize=128):\n        self.",
    "import os\nimport sys\n\n\ndef main():\n    for name in os.listdir(",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, ",
    "try:\n    import _thread\nexcept ImportError:\n    ",
    "def read_file(path, encoding='utf-8'):\n    with open(path, ",
    "    if not isinstance(value, str):\n        raise TypeError(",
    "for i, line in enumerate(lines):\n    if line.startswith('#'):\n        ",
]


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
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    target_forwards_per_token: float | None = None
    peak_memory_gb: float = 0.0
    baseline_peak_memory_gb: float = 0.0
    predicted_ratio: float | None = None
    measured_over_predicted: float | None = None
    auto_tps: float | None = None  # device policy auto (calibrated controller), same cell
    auto_over_plain: float | None = None
    auto_over_force_on: float | None = None
    auto_gate: str | None = None
    samples: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class DraftCell:
    """mlx-lm's speculative_generate_step with a draft model, batch 1."""

    k: int
    temp: float
    tps: float = 0.0
    baseline_tps: float = 0.0
    ratio: float = 0.0
    draft_token_share: float | None = None  # emitted tokens that came from the draft model


def regime() -> dict[str, Any]:
    import mlx_lm

    import melix_fsm

    return {
        "device": device_kind(),
        "blas": loaded_blas(read_proc_maps()) if sys.platform.startswith("linux") else "n/a",
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "melix_fsm": melix_fsm.__version__,
    }


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def _sampler(temp: float, tagged: bool) -> Any:
    if temp == 0:
        return None
    return make_sampler(temp=temp) if tagged else mlx_make_sampler(temp=temp)


def _run_batch(gen: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """(generation tokens/s, peak GB, tokens) for one generator run to completion."""
    mx.reset_peak_memory()
    with gen.stats() as stats:
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        while gen.next_generated():
            pass
    return stats.generation_tps, mx.get_peak_memory() / 1e9, stats.generation_tokens


def _run_single(responses: Iterable[Any]) -> tuple[float, float, Any]:
    mx.reset_peak_memory()
    last = None
    for response in responses:
        last = response
    return last.generation_tps, mx.get_peak_memory() / 1e9, last


class Bench:
    """Runs the cells; see the module rules."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        head: Any,
        *,
        family: str | None = None,
        draft_model: nn.Module | None = None,
        max_tokens: int = 64,
        repeats: int = 3,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.head = head
        self.family = family
        self.draft_model = draft_model
        self.max_tokens = max_tokens
        self.repeats = repeats
        self.progress = progress or (lambda n: None)
        self.prompts = [tokenizer.encode(p) for p in BENCH_PROMPTS]
        self.timings: dict[int, TimingTable] = {}

    def calibrate(self, batch_sizes: Sequence[int], ks: Sequence[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in ks:
            table = calibrate(self.model, self.head, batch_sizes=tuple(batch_sizes), k=k, runs=9)
            if isinstance(table, TimingTable):
                self.timings[k] = table
                out[str(k)] = [msgspec_builtins(t) for t in table.entries]
            else:
                out[str(k)] = {"error": table.reason, "detail": str(table)}
        return out

    def _prompts(self, batch_size: int) -> list[list[int]]:
        return [self.prompts[i % len(self.prompts)] for i in range(batch_size)]

    def batch_cell(self, batch_size: int, k: int, temp: float) -> Cell:
        cell = Cell("batch", batch_size, k, temp)
        prompts = self._prompts(batch_size)
        spec_stats = None
        auto_samples: list[float] = []
        for r in range(self.repeats):
            mx.random.seed(r)
            base = BatchGenerator(self.model, max_tokens=self.max_tokens, sampler=_sampler(temp, False))
            b_tps, b_mem, _ = _run_batch(base, prompts, self.max_tokens)
            base.close()
            mx.random.seed(r)
            gen = MTPBatchGenerator(
                self.model,
                self.head,
                num_draft_tokens=k,
                max_tokens=self.max_tokens,
                sampler=_sampler(temp, True),
            )
            m_tps, m_mem, tokens = _run_batch(gen, prompts, self.max_tokens)
            stats = gen.speculative_stats()
            spec_stats = stats if spec_stats is None else spec_stats
            cell.samples.append((b_tps, m_tps))
            controller = self._controller(k, batch_size)
            if controller is not None:
                mx.random.seed(r)
                auto = MTPBatchGenerator(
                    self.model,
                    self.head,
                    num_draft_tokens=k,
                    max_tokens=self.max_tokens,
                    sampler=_sampler(temp, True),
                    controller=controller,
                )
                auto_samples.append(_run_batch(auto, prompts, self.max_tokens)[0])
            cell.peak_memory_gb = max(cell.peak_memory_gb, m_mem)
            cell.baseline_peak_memory_gb = max(cell.baseline_peak_memory_gb, b_mem)
            cell.target_forwards_per_token = stats["row_forwards"] / max(tokens, 1)
            self.progress(1)
        self._finish(cell, spec_stats)
        if auto_samples:
            pairs = list(zip(cell.samples, auto_samples))
            cell.auto_tps = _median(auto_samples)
            cell.auto_over_plain = _median(a / b for (b, _), a in pairs if b > 0)
            cell.auto_over_force_on = _median(a / m for (_, m), a in pairs if m > 0)
            cell.auto_gate = self._gate(k, batch_size)
        return cell

    def _decision(self, k: int, batch_size: int) -> Any:
        table = self.timings.get(k)
        if table is None:
            return None, None
        timings, _ = table.at(batch_size)
        prior = acceptance_prior(self.family)
        return decide(timings, Policy.auto, prior), prior

    def _gate(self, k: int, batch_size: int) -> str | None:
        decision, _ = self._decision(k, batch_size)
        return None if decision is None else decision.hardware_gate.value

    def _controller(self, k: int, batch_size: int) -> ActivationController | None:
        """What `generate --device-policy auto` would run with at this batch size."""
        decision, prior = self._decision(k, batch_size)
        if decision is None:
            return None
        return ActivationController(self.timings[k], prior=prior, active=decision.speculate)

    def _plain_single(self, prompt: list[int], temp: float, seed: int) -> tuple[float, float]:
        """mlx-lm's plain `stream_generate`: (tokens/s, peak GB)."""
        mx.random.seed(seed)
        responses = stream_generate(
            self.model, self.tokenizer, prompt, self.max_tokens, sampler=_sampler(temp, False)
        )
        tps, mem, _ = _run_single(responses)
        return tps, mem

    def single_cell(self, k: int, temp: float) -> Cell:
        cell = Cell("single", 1, k, temp)
        prompt = self.prompts[0]
        last = None
        for r in range(self.repeats):
            b_tps, b_mem = self._plain_single(prompt, temp, seed=r)
            mx.random.seed(r)
            m_tps, m_mem, last = _run_single(
                mtp_stream_generate(
                    self.model,
                    self.tokenizer,
                    prompt,
                    self.head,
                    max_tokens=self.max_tokens,
                    num_draft_tokens=k,
                    sampler=_sampler(temp, True),
                )
            )
            cell.samples.append((b_tps, m_tps))
            cell.peak_memory_gb = max(cell.peak_memory_gb, m_mem)
            cell.baseline_peak_memory_gb = max(cell.baseline_peak_memory_gb, b_mem)
            stats = last.stats
            forwards = stats["target_forwards"] + stats["replay_forwards"]
            cell.target_forwards_per_token = forwards / max(last.generation_tokens, 1)
            self.progress(1)
        self._finish(cell, last.stats if last is not None else None)
        return cell

    def draft_cell(self, k: int, temp: float) -> DraftCell | None:
        if self.draft_model is None:
            return None
        cell = DraftCell(k, temp)
        prompt = self.prompts[0]
        samples = []
        accepted = total = 0
        for r in range(self.repeats):
            b_tps, _ = self._plain_single(prompt, temp, seed=r)
            mx.random.seed(r)
            responses = list(
                stream_generate(
                    self.model,
                    self.tokenizer,
                    prompt,
                    self.max_tokens,
                    draft_model=self.draft_model,
                    num_draft_tokens=k,
                    sampler=_sampler(temp, False),
                )
            )
            d_tps = responses[-1].generation_tps
            accepted += sum(r.from_draft for r in responses)
            total += len(responses)
            samples.append((b_tps, d_tps))
            self.progress(1)
        cell.baseline_tps = _median(b for b, _ in samples)
        cell.tps = _median(d for _, d in samples)
        cell.ratio = _median(d / b for b, d in samples if b > 0)
        # mlx-lm does not expose drafted positions, so acceptance cannot be computed; report
        # the share of emitted tokens that came from the draft model instead
        cell.draft_token_share = accepted / total if total else None
        return cell

    def _finish(self, cell: Cell, stats: dict[str, Any] | None) -> None:
        cell.baseline_tps = _median(b for b, _ in cell.samples)
        cell.tps = _median(m for _, m in cell.samples)
        cell.ratio = _median(m / b for b, m in cell.samples if b > 0)
        if stats is None:
            return
        cell.acceptance_rate = stats.get("acceptance_rate")
        cell.mean_acceptance_length = stats.get("mean_acceptance_length")
        cell.per_position_acceptance = list(stats.get("per_position_acceptance") or [])[: cell.k]
        table = self.timings.get(cell.k)
        if table is not None and cell.per_position_acceptance:
            timings, _ = table.at(cell.batch_size)
            tokens = expected_tokens_from_positions(cell.per_position_acceptance)
            cell.predicted_ratio = tokens / timings.cycle_cost
            cell.measured_over_predicted = cell.ratio / cell.predicted_ratio


def msgspec_builtins(value: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(value)


def run(
    model_dir: Path,
    *,
    draft_dir: Path | None,
    batch_sizes: Sequence[int],
    ks: Sequence[int],
    temps: Sequence[float],
    max_tokens: int,
    repeats: int,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Load, calibrate, run every cell; return the results as plain data."""
    from mlx_lm import load as mlx_load

    from .loading import load_with_heads

    model, tokenizer, head, info = load_with_heads(model_dir)
    draft_model = mlx_load(str(draft_dir))[0] if draft_dir is not None else None
    cells = len(batch_sizes) * len(ks) * len(temps) + len(ks) * len(temps) * (2 if draft_model else 1)
    bar = _progress_bar(cells * repeats, show_progress)
    bench = Bench(
        model,
        tokenizer,
        head,
        family=info.family,
        draft_model=draft_model,
        max_tokens=max_tokens,
        repeats=repeats,
        progress=bar.update,
    )
    started = time.perf_counter()
    calibration = bench.calibrate(batch_sizes, ks)
    results: dict[str, Any] = {
        "schema": "melix-fsm/bench/1",
        "regime": regime() | {"dtype": model_dtype(model)},
        "model": str(model_dir),
        "family": info.family,
        "draft_model": str(draft_dir) if draft_dir else None,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "calibration": calibration,
        "cells": [],
        "draft_cells": [],
    }
    for temp in temps:
        for k in ks:
            results["cells"].append(vars(bench.single_cell(k, temp)))
            for batch_size in batch_sizes:
                results["cells"].append(vars(bench.batch_cell(batch_size, k, temp)))
            draft = bench.draft_cell(k, temp)
            if draft is not None:
                results["draft_cells"].append(vars(draft))
    bar.close()
    results["wall_s"] = time.perf_counter() - started
    return results


def _progress_bar(total: int, show: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="bench runs", unit="run", disable=not show, file=sys.stderr)
