"""`melix-fsm verify`'s work: MTP against mlx-lm's own decode, for one model, dtype and device.

Rules of this module:
- `run_verify(model, head, ...)` runs, in order, each on fresh generators:
  1. identity, batched: `MTPBatchGenerator` (prefill 2, completion 3, the given k cycled
     over the batches) on fixed seeded schedules (ragged prompts, a queued request, a
     join into the running batch, a row finishing while others go on), every token
     against mlx-lm's `generate_step` on the same model object;
  2. identity, single-sequence: `mtp_generate_step` at each k, prompts decoded one by
     one, against the same reference;
  3. batch invariance (melix_fsm.testing.invariance): one prompt at each batch position,
     beside other neighbours, joining a running batch, against its own lone run;
  4. lifecycle and edge cases: the kit's probe schedules (melix_fsm.testing.probes),
     greedy, through the conformance driver (events checked);
  5. distribution: `draws` sampled continuations of 4 tokens at T = 1 against the
     model's own probabilities (the kit's G-test and mean-probability test, alpha 0.001).
  Every token comparison goes through one divergence judge (the contract in the
  model's logits dtype, or exact): near-ties are counted, anything else is a bug with
  its schedule. The ledger's rate and histogram are the run's divergence figures.
- The report is plain data (`as_dict`, the JSON to attach to a bug) and text (`text()`):
  the verdict, the divergence rate with margins, and the promise this run supports on
  this model, dtype and device, beside what the receipt resolves to.
- Progress: `progress("phase", text)` before each part.
- Profiles: `smoke` (CI: one schedule, 8 tokens, 6 probes, 200 draws), `quick` (the
  command's default: a few minutes on a laptop-sized model) and `full`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from melix_fsm.testing import mlx_greedy_reference
from melix_fsm.testing.distribution import check_distribution, draw_with_restarts, measure_distribution
from melix_fsm.testing.divergence import NEAR_TIE, DivergenceJudge, RoundingContract
from melix_fsm.testing.hunt import replay_error
from melix_fsm.testing.invariance import check_batch_invariance
from melix_fsm.testing.mirror import ConformanceError
from melix_fsm.testing.probes import probe_schedules
from melix_fsm.testing.reference import memoized

from .verify_report import ALPHA, Finding, VerifyReport, environment

PROFILES: dict[str, dict[str, int]] = {
    # schedules of 4 requests; tokens per request; prompts per depth decoded alone; sampled
    # draws; tokens per invariance request; probe schedules (0: every one)
    "smoke": {"batches": 1, "max_tokens": 8, "singles": 1, "draws": 200, "invariance_tokens": 6, "probes": 6},
    "quick": {
        "batches": 3,
        "max_tokens": 24,
        "singles": 2,
        "draws": 600,
        "invariance_tokens": 16,
        "probes": 0,
    },
    "full": {
        "batches": 8,
        "max_tokens": 64,
        "singles": 4,
        "draws": 2000,
        "invariance_tokens": 32,
        "probes": 0,
    },
}
Progress = Callable[[str, Any], None]


def _prompt(rng: random.Random, top: int, lo: int = 3, hi: int = 24) -> list[int]:
    return [rng.randint(3, top) for _ in range(rng.randint(lo, hi))]


def batched_schedules(
    seed: int, top: int, batches: int, max_tokens: int, k: int
) -> list[list[dict[str, Any]]]:
    """Fixed shapes: 3 ragged prompts (the third queued), a short one, a later join."""
    rng = random.Random(seed)
    out = []
    for b in range(batches):
        depth = k - b % k  # k, k - 1, ..., 1, then k again
        opts = {"num_draft_tokens": depth}

        def req(n: int, opts: dict[str, Any] = opts) -> dict[str, Any]:
            return {"prompt": _prompt(rng, top), "max_tokens": n, "stops": [], "options": dict(opts)}

        first = [req(max_tokens), req(max(2, max_tokens // 4)), req(max_tokens)]
        out.append(
            [
                {"op": "insert", "requests": first},
                {"op": "next"},
                {"op": "next"},
                {"op": "insert", "requests": [req(max_tokens)]},
                {"op": "drain"},
            ]
        )
    return out


def run_verify(
    model: Any,
    head: Any,
    *,
    settings: dict[str, Any],
    judge: DivergenceJudge | None,
    contract: RoundingContract | None,
    profile: dict[str, int],
    k: int = 3,
    progress: Progress | None = None,
) -> VerifyReport:
    """Every part of the verification (module rules); `settings` go into the report as they are."""
    mx.random.seed(int(settings["seed"]))  # the sampled draws replay with the seed too
    report = VerifyReport(dict(settings), contract, judge.ledger if judge is not None else None)
    run = _Verification(model, head, report, judge, profile, k, progress or (lambda kind, value: None))
    schedules = batched_schedules(run.seed, run.top, profile["batches"], profile["max_tokens"], k)
    run.part("identity, batched", lambda: run.schedules("identity, batched", schedules, run.batched))
    run.part("identity, single-sequence", run.singles)
    run.part("batch invariance (vs lone run)", run.invariance)
    run.part("lifecycle and edge-case probes", run.probes)
    run.part(f"distribution ({profile['draws']} draws, T = 1)", run.distribution)
    return report


class _Verification:
    """One verification's shared state (model, report, judge, reference); a method per part."""

    def __init__(
        self,
        model: Any,
        head: Any,
        report: VerifyReport,
        judge: DivergenceJudge | None,
        profile: dict[str, int],
        k: int,
        tell: Progress,
    ) -> None:
        self.model, self.head, self.report, self.judge = model, head, report, judge
        self.profile, self.k, self.tell = profile, k, tell
        self.seed = int(report.settings["seed"])
        self.top = min(int(report.settings["vocab_size"]), 1000) - 1
        self.reference = memoized(mlx_greedy_reference(model, min_tokens=profile["max_tokens"]))

    def batched(self, temperature: float = 0.0, sizes: tuple[int, int] = (2, 3)) -> Any:
        from melix_mlx.batch_generator import MTPBatchGenerator
        from melix_mlx.runtime.sampling import make_sampler

        return MTPBatchGenerator(
            self.model,
            self.head,
            num_draft_tokens=self.k,
            sampler=make_sampler(temp=temperature),
            prefill_batch_size=sizes[0],
            completion_batch_size=sizes[1],
        )

    def counted(self) -> int:
        return self.report.ledger.tokens if self.report.ledger is not None else 0

    def part(self, name: str, run: Callable[[], str]) -> None:
        self.tell("phase", name)
        t0, before = time.perf_counter(), self.counted()
        result = run()
        self.report.parts[name] = {
            "tokens": self.counted() - before,
            "seconds": time.perf_counter() - t0,
            "result": result,
        }

    def schedules(
        self, name: str, schedules: list[list[dict[str, Any]]], make: Callable[[], Any], **kw: Any
    ) -> str:
        failed = 0
        for schedule in schedules:
            err = replay_error(schedule, make, self.reference, judge=self.judge, **kw)
            if err is not None:
                failed += 1
                self.report.findings.append(Finding(name, err, schedule))
        ledger = self.report.ledger
        near = ledger.count(NEAR_TIE) if ledger is not None else 0
        return f"{failed} bug(s)" if failed else ("pass" + (f", {near} near-tie(s) so far" if near else ""))

    def singles(self) -> str:
        from melix_mlx.decoding.generate import mtp_generate_step

        rng = random.Random(self.seed + 1)
        out = []
        for depth in range(1, self.k + 1):
            requests = [
                {
                    "prompt": _prompt(rng, self.top),
                    "max_tokens": self.profile["max_tokens"],
                    "stops": [],
                    "options": {},
                }
                for _ in range(self.profile["singles"])
            ]

            def stream(depth: int = depth) -> Any:
                return lambda prompt, n: mtp_generate_step(
                    mx.array(prompt), self.model, self.head, max_tokens=n, num_draft_tokens=depth
                )

            out.append(
                self.schedules(
                    "identity, single",
                    [[{"op": "insert", "requests": requests}, {"op": "drain"}]],
                    stream,  # a fresh stream function (the generator) per schedule
                    surface="stream",
                )
            )
        return "; ".join(f"k={i + 1}: {r}" for i, r in enumerate(out))

    def invariance(self) -> str:
        rng = random.Random(self.seed + 2)
        top = self.top
        prompt = _prompt(rng, top, 4, 12)
        neighbours = [_prompt(rng, top, 12, 24), _prompt(rng, top, 1, 3)]
        others = [_prompt(rng, top, 2, 6), _prompt(rng, top, 16, 24)]
        report = self.report
        report.invariance = check_batch_invariance(
            lambda: self.batched(sizes=(4, 4)),
            prompt,
            neighbours,
            others,
            self.profile["invariance_tokens"],
            judge=self.judge,
            options={"num_draft_tokens": self.k},
            progress=self.tell,
        )
        for case in report.invariance:
            if case.error is not None:
                report.findings.append(Finding(f"batch invariance, {case.name}", case.error, case.schedule))
        verdicts = {c.verdict for c in report.invariance}
        if "FAIL" in verdicts:
            return "FAIL"
        return "within contract" if "within contract" in verdicts else "bit-exact"

    def probes(self) -> str:
        k = self.k
        options = {"num_draft_tokens": [k, max(1, k - 1), 1]}
        shapes = [s for _, s in probe_schedules(self.seed, tokens=(3, self.top), options=options)]
        if self.profile["probes"]:
            shapes = shapes[: self.profile["probes"]]
        return self.schedules("lifecycle probes", shapes, self.batched)

    def distribution(self) -> str:
        from melix_mlx.tools.qa.probabilities import target_probabilities

        rng = random.Random(self.seed + 3)
        start = [rng.randint(3, self.top) for _ in range(2)]
        prompt = start + list(self.reference(tuple(start), 6))  # a context the model is confident in
        draws = self.profile["draws"]
        samples, crashes = draw_with_restarts(lambda: self.batched(1.0, (16, 64)), prompt, draws, 4)
        probs = target_probabilities(self.model, 1.0)
        result = measure_distribution(samples, probs, prompt, alpha=ALPHA, positions=4)
        result.crashes = len(crashes)
        self.report.distribution = result
        for err in crashes:
            self.report.findings.append(Finding("distribution", err, []))
        if crashes:
            return f"{len(crashes)} crash(es): inconclusive"
        try:
            check_distribution(samples, probs, prompt, alpha=ALPHA)
        except ConformanceError as err:
            self.report.distribution_failed = f"{err.prop}: {err.detail}"
            return "FAIL"
        return "pass"


__all__ = ["PROFILES", "VerifyReport", "batched_schedules", "environment", "run_verify"]
