"""The benchmark harness: MTP against mlx-lm's own decode paths, side by side in one run.
(Over 400 lines: the cells' interleaved loops read together; the records live in
bench_results.py, the report in bench_report.py, the prompts in workloads.py.)

Rules of this module:
- Every figure is a ratio of two measurements taken in the same process, interleaved
  (baseline, candidates; then the candidates and the baseline in reverse: ABBA, so drift
  through a repeat favours no side) and summarised by the median, with the spread (min,
  max) of the per-repeat ratios, so slow drift of a shared machine hits both sides alike
  and the noise is visible. Absolute tokens/s are reported too; only ratios
  are claims.
- Baselines: mlx-lm's `BatchGenerator` at the same batch size (every batch cell), mlx-lm's
  plain `stream_generate` (single cells) and its `speculative_generate_step` with a draft
  model (batch 1).
- Each cell runs, interleaved: plain (mlx-lm), MTP forced on, and MTP under the device
  policy's `auto` (the live controller `generate --device-policy auto` would run, primed
  by this run's calibration, or disabled by its typed failure: then auto is the plain
  path and the gate says `disabled`); at the deepest k also `auto` depth. `auto_over_best`
  is auto / max(plain, forced on) per repeat.
- A/A control (on unless `aa_control=False`): each repeat runs the baseline once more, last
  in its order (first in the reversed one), and records its tokens/s over the first
  baseline run's. Identical work at the widest spacing a repeat has: the range of these
  ratios is how far this run's machine moves a ratio by itself, so a figure inside it is
  not a difference.
- Ideal: E[tokens per cycle] / ((t_verify + k t_head) / t_1) from this run's calibrated
  timings and the cell's measured per-position acceptance; efficiency = measured ratio /
  ideal, each repeat against its own run's acceptance (single cells decode a different
  prompt per repeat), the median reported. Each batch size is calibrated at the context
  its cells' caches hold mid-run (a batch is left-padded to its longest prompt, plus
  half the generated tokens). With `calibrate_each_repeat` every repeat is priced by a
  calibration taken just before it (`Cell.cycle_costs`), so the ideal and the ratio it
  divides come from the same minutes of the machine: a single calibration's noise and
  the drift between it and the cells no longer move every repeat alike.
  The per-cycle breakdown puts the calibrated verify and head times beside the
  engine's measured host times (graph build, dispatch, sync wait, rollback, caller's
  bookkeeping) and the host time no device work covered: cycle - (t_verify + k t_head).
- Fill (batch cells): row-steps over verify forwards x B in the forced-on runs. A fixed
  batch runs until its slowest row is done, so rows that finish early leave slots idle;
  the ideal assumes every slot works, and 1 - fill is how much of it the tail took.
- Batch cells run a fixed batch by default: B requests, all inserted at once, each
  generating max_tokens. With `requests_per_slot` N > 1 they run continuous batching
  instead: B x N requests queued to generators capped at B rows, so a finished row is
  replaced from the queue (what a server does) and the tail of rows that finish at
  different steps is paid once per cell, not once per B requests. Both generators get
  the same cap and queue.
- Prompts are held-out text per workload (melix_mlx.tools.workloads) or the user's
  (`--prompts FILE`); acceptance is reported per workload and draft position.
- Throughput is generation tokens over generation time, prompt processing excluded, read
  from each generator's own counters (mlx-lm's `BatchStats` for both batch generators,
  `generation_tps` of the last response for the single-sequence paths).
- The regime (device, BLAS loaded into this process, dtype, versions) is recorded with
  the results: the same machine gives opposite verdicts in different regimes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

from melix_fsm.counters import Counters, total
from melix_fsm.policy.calibration import DEFAULT_BUDGET_S
from melix_fsm.policy.controller import LiveController
from melix_fsm.policy.cost_model import TimingTable, acceptance_prior, expected_tokens_from_positions
from melix_fsm.policy.decision import Policy, decide
from melix_fsm.policy.errors import CalibrationError
from melix_fsm.policy.live_types import LiveConfig

from ..decoding.batch_generator import MTPBatchGenerator
from ..decoding.decode import MTPDecoder
from ..decoding.generate import mtp_stream_generate
from ..runtime.calibrate import calibrate, model_dtype
from ..runtime.cycle_clock import CycleClock
from ..runtime.sampling import make_sampler
from .bench_results import AUTO_COUNTERS, Cell, DraftCell, msgspec_builtins, regime
from .workloads import Prompt, held_out_prompts


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def _sampler(temp: float, tagged: bool) -> Any:
    if temp == 0:
        return None
    return make_sampler(temp=temp) if tagged else mlx_make_sampler(temp=temp)


def _interleaved(repeat: int, runs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run one repeat's runs in order on even repeats, reversed on odd ones (ABBA), so a
    machine that drifts through a repeat favours no side; results by name."""
    order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
    return {name: runs[name]() for name in order}


def _run_batch(gen: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float]:
    """(generation tokens/s, peak GB, prompt tokens/s) for one generator run to completion."""
    mx.reset_peak_memory()
    with gen.stats() as stats:
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        while gen.next_generated():
            pass
    return stats.generation_tps, mx.get_peak_memory() / 1e9, stats.prompt_tps


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
        requests_per_slot: int = 1,
        prompts: Sequence[Prompt] = (),
        progress: Callable[[int], None] | None = None,
        aa_control: bool = True,
        calibrate_each_repeat: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.head = head
        self.family = family
        self.draft_model = draft_model
        self.max_tokens = max_tokens
        self.repeats = repeats
        self.requests_per_slot = requests_per_slot
        self.aa_control = aa_control
        self.calibrate_each_repeat = calibrate_each_repeat
        self.progress = progress or (lambda n: None)
        self.workload_prompts = list(prompts)
        self.prompts = [tokenizer.encode(p.text) for p in self.workload_prompts]
        self.timings: dict[int, TimingTable] = {}
        # a calibration that failed: auto runs disabled there, as `generate` would
        self.failures: dict[int, CalibrationError] = {}

    @classmethod
    def open(cls, model_dir: Path, **options: Any) -> Bench:
        """A Bench over a checkpoint folder: its model, tokenizer, head and family, and its
        held-out prompts unless `prompts` is given (`run` and the scripts in benchmarks/)."""
        from melix_fsm.config import speculative_config
        from melix_fsm.receipt import ServingContext

        from ..decoding.startup import start

        # the start every command makes (receipt, typed refusals, load); the cells measure
        # speculation themselves, so the device policy is not evaluated here
        config = speculative_config(method="mtp", device_policy="force_on")
        boot = start(Path(model_dir), config, ServingContext(), evaluate_policy=False)
        options["prompts"] = list(options.get("prompts") or held_out_prompts(model_dir))
        return cls(boot.model, boot.tokenizer, boot.head, family=boot.receipt.family, **options)

    def context(self, batch_size: int) -> int:
        """Tokens the cell's cache holds mid-run: attention costs grow with it. A batch's
        rows are left-padded to its longest prompt, so a batch is priced at that length
        (single-sequence cells run each prompt: their median)."""
        if batch_size == 1:
            prompt = int(_median(len(p) for p in self.prompts))
        else:
            prompt = max(len(p) for p in self._prompts(batch_size))
        return prompt + self.max_tokens // 2

    def calibrate(self, batch_sizes: Sequence[int], ks: Sequence[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        contexts = {b: self.context(b) for b in batch_sizes}
        for k in ks:
            # all sizes in one calibration: their figures are checked against each other
            table = calibrate(
                self.model,
                self.head,
                batch_sizes=batch_sizes,
                k=k,
                runs=9,
                context=contexts,
                budget_s=DEFAULT_BUDGET_S * len(batch_sizes),
            )
            if isinstance(table, TimingTable):
                self.timings[k] = table
                out[str(k)] = [msgspec_builtins(t) for t in table.entries]
            else:
                self.failures[k] = table
                out[str(k)] = {"error": table.reason, "detail": str(table)}
        return out

    def repeat_cost(self, k: int, batch_size: int) -> float | None:
        """With `calibrate_each_repeat`: the cycle cost (t_verify + k t_head) / t_1 of a
        calibration at this cell's size taken now; None when off or when it failed (the
        repeat is then priced by the cell's table, and the failure is not hidden: the cell's
        `cycle_costs` holds None there)."""
        if not self.calibrate_each_repeat or k not in self.timings:
            return None
        table = calibrate(
            self.model,
            self.head,
            batch_sizes=[batch_size],
            k=k,
            runs=9,
            context=self.context(batch_size),
            budget_s=DEFAULT_BUDGET_S,
        )
        return table.at(batch_size)[0].cycle_cost if isinstance(table, TimingTable) else None

    def _prompts(self, batch_size: int) -> list[list[int]]:
        return [self.prompts[i % len(self.prompts)] for i in range(batch_size)]

    def _slots(self, batch_size: int) -> dict[str, int]:
        """Both generators' row cap: the cell's batch size (prefill in chunks of at most 8,
        mlx-lm's default), so queued requests wait for a free row."""
        return {"completion_batch_size": batch_size, "prefill_batch_size": min(batch_size, 8)}

    # -- the auto policy, as `generate --device-policy auto` runs it ------------------
    def _decision(self, k: int, batch_size: int) -> Any:
        """auto's admission at (k, B): from the calibration, or disabled by its typed failure
        (None: not calibrated at all)."""
        table = self.timings.get(k)
        measured = self.failures.get(k) if table is None else table.at(batch_size)[0]
        if measured is None:
            return None, None
        prior = acceptance_prior(self.family)
        return decide(measured, Policy.auto, prior), prior

    def _gate(self, k: int, batch_size: int) -> str | None:
        decision, _ = self._decision(k, batch_size)
        return None if decision is None else decision.hardware_gate.value

    def auto_controller(
        self, k: int, batch_size: int, depth: int | str | None = None, config: LiveConfig | None = None
    ) -> LiveController | None:
        """A fresh controller as `generate --device-policy auto` would build it at (k, B):
        this run's calibration and the family's prior (None: k never calibrated)."""
        decision, prior = self._decision(k, batch_size)
        if decision is None:
            return None
        return LiveController(
            self.timings.get(k) or self.failures[k],
            prior=prior,
            policy=Policy.auto,
            depth=depth if depth is not None else k,
            max_depth=k,
            batch_size=batch_size,
            active=decision.speculate,
            config=config,
        )

    # -- cells ----------------------------------------------------------------------------
    def batch_cell(self, batch_size: int, k: int, temp: float, deepest: bool = False) -> Cell:
        """One batch cell: plain, MTP, auto (and auto depth) interleaved per repeat.

        Over 80 lines: each method's run is a closure over the cell's options and the
        repeat loop's records read together, as in `single_cell`."""
        cell = Cell("batch", batch_size, k, temp)
        prompts = self._prompts(batch_size * self.requests_per_slot)
        spec_stats: list[dict[str, Any]] = []
        clock = CycleClock()
        auto: list[float] = []
        auto_depth: list[float] = []
        auto_share: list[float] = []
        auto_controllers: list[LiveController] = []
        fills: list[float] = []
        prompt_ratios: list[float] = []
        depth_k = None

        def mtp(
            controller: Any = None, cycle_clock: CycleClock | None = None
        ) -> tuple[float, float, Any, float]:
            gen = MTPBatchGenerator(
                self.model,
                self.head,
                num_draft_tokens=k,
                max_tokens=self.max_tokens,
                sampler=_sampler(temp, True),
                controller=controller,
                **self._slots(batch_size),
            )
            run_clock = CycleClock()
            gen.engine.clock = run_clock
            tps, mem, prompt_tps = _run_batch(gen, prompts, self.max_tokens)
            if cycle_clock is not None:
                cycle_clock.merge(run_clock)
            return tps, mem, gen, prompt_tps

        def plain(seed: int) -> tuple[float, float, float]:
            mx.random.seed(seed)
            slots, sampler = self._slots(batch_size), _sampler(temp, False)
            base = BatchGenerator(self.model, max_tokens=self.max_tokens, sampler=sampler, **slots)
            tps, mem, prompt_tps = _run_batch(base, prompts, self.max_tokens)
            base.close()
            return tps, mem, prompt_tps

        def seeded(seed: int, controller: Any = None, cycle_clock: CycleClock | None = None) -> Any:
            mx.random.seed(seed)
            return mtp(controller, cycle_clock)

        for r in range(self.repeats):
            cell.cycle_costs.append(self.repeat_cost(k, batch_size))
            controller = self.auto_controller(k, batch_size)
            chooser = self.auto_controller(k, batch_size, depth="auto") if deepest and k > 1 else None
            runs: dict[str, Callable[[], Any]] = {
                "plain": partial(plain, r),
                "mtp": partial(seeded, r, cycle_clock=clock),
            }
            if controller is not None:
                runs["auto"] = partial(seeded, r, controller)
                if chooser is not None:
                    runs["auto_depth"] = partial(seeded, r, chooser)
            if self.aa_control:
                runs["plain_again"] = partial(plain, r)
            out = _interleaved(r, runs)
            (b_tps, b_mem, b_prompt), (m_tps, m_mem, gen, m_prompt) = out["plain"], out["mtp"]
            self._aa(cell, out)
            if b_prompt > 0:
                prompt_ratios.append(m_prompt / b_prompt)
            stats = gen.speculative_stats()
            spec_stats.append(stats)
            cell.samples.append((b_tps, m_tps))
            if controller is not None:
                auto.append(out["auto"][0])
                auto_share.append(1.0 - controller.counters.steps_suspended / max(controller.step, 1))
                auto_controllers.append(controller)
            if chooser is not None:
                auto_depth.append(out["auto_depth"][0])
                depth_k = chooser.k
            cell.peak_memory_gb = max(cell.peak_memory_gb, m_mem)
            cell.baseline_peak_memory_gb = max(cell.baseline_peak_memory_gb, b_mem)
            cell.target_forwards_per_token = stats["row_forwards"] / max(stats["emitted"], 1)
            fills.append(stats["row_forwards"] / max(stats["target_forwards"] * batch_size, 1))
            cell.replay_forwards += stats["replay_forwards"]
            self.progress(1)
        cell.batch_fill = _median(fills)
        cell.prompt_ratio = _median(prompt_ratios) if prompt_ratios else None
        self._finish(cell, spec_stats, clock)
        self._auto(cell, auto, auto_share, auto_depth, depth_k, auto_controllers)
        return cell

    @staticmethod
    def _aa(cell: Cell, out: dict[str, Any]) -> None:
        """Record the repeat's A/A ratio: the baseline's second run over its first."""
        if "plain_again" in out and out["plain"][0] > 0:
            cell.aa_ratios.append(out["plain_again"][0] / out["plain"][0])

    def _auto(
        self,
        cell: Cell,
        auto: list[float],
        share: list[float],
        depth: list[float],
        depth_k: Any,
        controllers: list[LiveController],
    ) -> None:
        if not auto:
            return
        cell.auto_counters = {
            name: sum(getattr(c.counters, name) for c in controllers) for name in AUTO_COUNTERS
        }
        pairs = list(zip(cell.samples, auto))
        cell.auto_tps = _median(auto)
        cell.auto_over_plain = _median(a / b for (b, _), a in pairs if b > 0)
        cell.auto_over_force_on = _median(a / m for (_, m), a in pairs if m > 0)
        cell.auto_over_best = _median(a / max(b, m) for (b, m), a in pairs if max(b, m) > 0)
        cell.auto_gate = self._gate(cell.k, cell.batch_size)
        cell.auto_speculating_share = _median(share)
        if depth:
            cell.auto_depth_over_plain = _median(d / b for (b, _), d in zip(cell.samples, depth) if b > 0)
            cell.auto_depth_k = depth_k

    def _plain_single(self, prompt: list[int], temp: float, seed: int) -> tuple[float, float, float]:
        """mlx-lm's plain `stream_generate`: (tokens/s, peak GB, prompt tokens/s)."""
        mx.random.seed(seed)
        responses = stream_generate(
            self.model, self.tokenizer, prompt, self.max_tokens, sampler=_sampler(temp, False)
        )
        tps, mem, last = _run_single(responses)
        return tps, mem, last.prompt_tps

    def _mtp_single(
        self, prompt: list[int], k: int, temp: float, seed: int, controller: Any = None, clock: Any = None
    ) -> tuple[float, float, Any]:
        mx.random.seed(seed)
        run_clock = CycleClock()
        out = _run_single(
            mtp_stream_generate(
                self.model,
                self.tokenizer,
                prompt,
                self.head,
                max_tokens=self.max_tokens,
                num_draft_tokens=k,
                sampler=_sampler(temp, True),
                controller=controller,
                clock=run_clock,
            )
        )
        if clock is not None:
            clock.merge(run_clock)
        return out

    def single_cell(self, k: int, temp: float, deepest: bool = False) -> Cell:
        cell = Cell("single", 1, k, temp)
        last = None
        runs_stats: list[dict[str, Any]] = []
        clock = CycleClock()
        auto: list[float] = []
        auto_depth: list[float] = []
        auto_share: list[float] = []
        auto_controllers: list[LiveController] = []
        prompt_ratios: list[float] = []
        depth_k = None
        for r in range(self.repeats):
            prompt = self.prompts[r % len(self.prompts)]
            cell.cycle_costs.append(self.repeat_cost(k, 1))
            controller = self.auto_controller(k, 1)
            chooser = self.auto_controller(k, 1, depth="auto") if deepest and k > 1 else None
            runs: dict[str, Callable[[], Any]] = {
                "plain": partial(self._plain_single, prompt, temp, seed=r),
                "mtp": partial(self._mtp_single, prompt, k, temp, r, clock=clock),
            }
            if controller is not None:
                runs["auto"] = partial(self._mtp_single, prompt, k, temp, r, controller=controller)
                if chooser is not None:
                    runs["auto_depth"] = partial(self._mtp_single, prompt, k, temp, r, controller=chooser)
            if self.aa_control:
                runs["plain_again"] = runs["plain"]
            out = _interleaved(r, runs)
            (b_tps, b_mem, b_prompt), (m_tps, m_mem, last) = out["plain"], out["mtp"]
            self._aa(cell, out)
            if b_prompt > 0:
                prompt_ratios.append(last.prompt_tps / b_prompt)
            cell.samples.append((b_tps, m_tps))
            if controller is not None:
                auto.append(out["auto"][0])
                auto_share.append(1.0 - controller.counters.steps_suspended / max(controller.step, 1))
                auto_controllers.append(controller)
            if chooser is not None:
                auto_depth.append(out["auto_depth"][0])
                depth_k = chooser.k
            cell.peak_memory_gb = max(cell.peak_memory_gb, m_mem)
            cell.baseline_peak_memory_gb = max(cell.baseline_peak_memory_gb, b_mem)
            stats = last.stats
            runs_stats.append(stats)
            forwards = stats["target_forwards"] + stats["replay_forwards"]
            cell.target_forwards_per_token = forwards / max(last.generation_tokens, 1)
            cell.replay_forwards += stats["replay_forwards"]
            self.progress(1)
        cell.prompt_ratio = _median(prompt_ratios) if prompt_ratios else None
        self._finish(cell, runs_stats, clock)
        self._auto(cell, auto, auto_share, auto_depth, depth_k, auto_controllers)
        return cell

    def draft_cell(self, k: int, temp: float) -> DraftCell | None:
        if self.draft_model is None:
            return None
        cell = DraftCell(k, temp)
        samples = []
        accepted = total = 0
        for r in range(self.repeats):
            prompt = self.prompts[r % len(self.prompts)]
            b_tps = self._plain_single(prompt, temp, seed=r)[0]
            mx.random.seed(r)
            try:
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
            except ValueError as exc:  # e.g. recurrent caches: mlx-lm's draft path refuses them
                cell.refused = str(exc)
                self.progress(self.repeats - r)
                return cell
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

    def _finish(self, cell: Cell, runs: list[dict[str, Any]], clock: CycleClock) -> None:
        """Ratios, acceptance and the ideal from the forced-on runs' stats, one per repeat.

        Each repeat's ratio is set against the ideal of its own acceptance (repeats may
        decode different prompts): efficiency is the median of those quotients.
        """
        ratios = [m / b for b, m in cell.samples if b > 0]
        cell.baseline_tps = _median(b for b, _ in cell.samples)
        cell.tps = _median(m for _, m in cell.samples)
        cell.ratio = _median(ratios)
        cell.ratio_min, cell.ratio_max = (min(ratios), max(ratios)) if ratios else (0.0, 0.0)
        if not runs:
            return
        pooled = total([msgspec.convert(r, Counters) for r in runs])  # derived keys are ignored
        cell.acceptance_rate = pooled.acceptance_rate
        cell.mean_acceptance_length = pooled.mean_acceptance_length
        cell.per_position_acceptance = pooled.per_position_acceptance[: cell.k]
        table = self.timings.get(cell.k)
        if table is None or not cell.per_position_acceptance:
            return
        timings = table.at(cell.batch_size)[0]
        costs = [c or timings.cycle_cost for c in cell.cycle_costs] or [timings.cycle_cost] * len(runs)
        ideals = [
            expected_tokens_from_positions(r["per_position_acceptance"][: cell.k]) / cost
            for r, cost in zip(runs, costs)
        ]
        cell.ideal_ratio = _median(ideals)
        cell.efficiencies = [
            m / b / ideal for (b, m), ideal in zip(cell.samples, ideals) if b > 0 and ideal > 0
        ]
        cell.efficiency = _median(cell.efficiencies)
        if clock.cycles:
            parts = clock.per_cycle()
            cycle = sum(parts.values())
            device = timings.t_verify + cell.k * timings.t_head
            cell.breakdown_ms = {
                "verify": timings.t_verify * 1e3,
                "head": cell.k * timings.t_head * 1e3,
                **{name: value * 1e3 for name, value in parts.items()},
                "cycle": cycle * 1e3,
                "not_overlapped": (cycle - device) * 1e3,
            }

    # -- acceptance per workload -----------------------------------------------------------
    def workload_acceptance(self, k: int) -> list[dict[str, Any]]:
        """Greedy MTP over each prompt at depth k: per-position acceptance per workload."""
        by_workload: dict[str, list[dict[str, Any]]] = {}
        for prompt, tokens in zip(self.workload_prompts, self.prompts):
            decoder = MTPDecoder(self.model, self.head, num_draft_tokens=k)
            for _ in decoder.generate(mx.array(tokens), self.max_tokens):
                pass
            by_workload.setdefault(prompt.workload, []).append(decoder.stats)
        out = []
        for workload, runs in by_workload.items():
            proposed = sum(s["proposed"] for s in runs)
            accepted = sum(s["accepted"] for s in runs)
            per_run = [s["per_position_acceptance"] for s in runs]
            positions = [_median(p[j] for p in per_run if len(p) > j) for j in range(k)]
            lengths = [len(t) for p, t in zip(self.workload_prompts, self.prompts) if p.workload == workload]
            out.append(
                {
                    "workload": workload,
                    "prompts": len(runs),
                    "prompt_tokens": _median(lengths),
                    "k": k,
                    "acceptance_rate": accepted / proposed if proposed else None,
                    "per_position_acceptance": positions,
                }
            )
        return out


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
    prompts: Sequence[Prompt] | None = None,
    requests_per_slot: int = 1,
    aa_control: bool = True,
) -> dict[str, Any]:
    """Load, calibrate, run every cell; return the results as plain data."""
    from mlx_lm import load as mlx_load

    draft_model = mlx_load(str(draft_dir))[0] if draft_dir is not None else None
    cells = len(batch_sizes) * len(ks) * len(temps) + len(ks) * len(temps) * (2 if draft_model else 1)
    bar = _progress_bar(cells * repeats, show_progress)
    bar.note("loading the model")
    bench = Bench.open(
        model_dir,
        draft_model=draft_model,
        max_tokens=max_tokens,
        repeats=repeats,
        requests_per_slot=requests_per_slot,
        prompts=prompts,
        progress=bar.update,
        aa_control=aa_control,
    )
    started = time.perf_counter()
    bar.note("calibrating")
    # batch 1 always: the single-sequence cells' ideal and auto are priced there
    calibration = bench.calibrate(sorted({1, *batch_sizes}), ks)
    results: dict[str, Any] = {
        "schema": "melix-fsm/bench/2",
        "regime": regime() | {"dtype": model_dtype(bench.model)},
        "model": str(model_dir),
        "family": bench.family,
        "draft_model": str(draft_dir) if draft_dir else None,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "requests_per_slot": requests_per_slot,
        "aa_control": aa_control,
        "calibration": calibration,
        "prompts": [
            {"workload": p.workload, "source": p.source, "chars": len(p.text)} for p in bench.workload_prompts
        ],
        "workloads": bench.workload_acceptance(max(ks)),
        "cells": [],
        "draft_cells": [],
    }
    for temp in temps:
        for k in ks:
            deepest = k == max(ks)
            results["cells"].append(vars(bench.single_cell(k, temp, deepest)))
            for batch_size in batch_sizes:
                results["cells"].append(vars(bench.batch_cell(batch_size, k, temp, deepest)))
            draft = bench.draft_cell(k, temp)
            if draft is not None:
                results["draft_cells"].append(vars(draft))
    bar.close()
    results["wall_s"] = time.perf_counter() - started
    return results


def _progress_bar(total: int, show: bool) -> Any:
    # a tqdm bar on a terminal, a few plain lines in a log (no carriage-return spam)
    from melix_fsm.commands.progress import Progress

    return Progress(total, "bench runs", enabled=show)
