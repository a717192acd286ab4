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

import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx

from melix_fsm.testing import mlx_greedy_reference
from melix_fsm.testing.distribution import check_distribution, draw_with_restarts, measure_distribution
from melix_fsm.testing.divergence import NEAR_TIE, DivergenceJudge, DivergenceLedger, RoundingContract
from melix_fsm.testing.hunt import replay_error
from melix_fsm.testing.invariance import CaseResult, check_batch_invariance
from melix_fsm.testing.mirror import ConformanceError
from melix_fsm.testing.probes import probe_schedules
from melix_fsm.testing.reference import memoized

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
ALPHA = 1e-3
Progress = Callable[[str, Any], None]


@dataclass
class Finding:
    part: str
    error: ConformanceError
    schedule: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        d = getattr(self.error, "divergence", None)
        return {
            "part": self.part,
            "property": self.error.prop,
            "where": self.error.where,
            "detail": self.error.detail,
            "divergence": d.as_dict() if d is not None else None,
            "schedule": self.error.schedule or self.schedule,
        }


@dataclass
class VerifyReport:
    settings: dict[str, Any]
    contract: RoundingContract | None
    ledger: DivergenceLedger | None
    findings: list[Finding] = field(default_factory=list)
    invariance: list[CaseResult] = field(default_factory=list)
    distribution: Any = None
    distribution_failed: str = ""
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # per part: tokens, seconds
    receipt: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.findings and not self.distribution_failed

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def identity(self) -> str:
        """The identity this run measured: bit-exact, within the contract, or failed."""
        if any(f.error.prop == "tokens_match_reference" for f in self.findings):
            return "FAIL"
        near = self.ledger.divergences if self.ledger is not None else []
        return "within contract" if near else "bit-exact"

    def promise(self) -> str:
        s = self.settings
        weights = "" if s.get("weights", "dense") == "dense" else f" with {s['weights']} weights"
        where = (
            f"{s['model']} in {s['dtype']}{weights} on {s['device']} (mlx {s['mlx']}, mlx-lm {s['mlx_lm']})"
        )
        tokens = self.ledger.tokens if self.ledger is not None else s.get("tokens_compared", 0)
        if not self.ok:
            found = len(self.findings) + bool(self.distribution_failed)
            return f"none: this run found {found} bug(s) on {where}"
        head = "greedy output with MTP (single-sequence and batched) equals mlx-lm's own decode of " + where
        if self.identity() == "bit-exact":
            head += f" token for token: 0 divergences in {tokens} tokens compared"
        else:
            n = len(self.ledger.divergences)
            head += (
                f" up to near-ties of the rounding contract ({self.contract.describe()}): {n} in {tokens} "
                f"tokens compared ({self.ledger.per_1000():.3g} per 1,000), no bug"
            )
        if self.distribution is not None:
            head += "; sampled output follows the model's distribution (alpha 0.001)"
        return head

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "verdict": "pass" if self.ok else "fail",
            "identity": self.identity(),
            "promise": self.promise(),
            "receipt": self.receipt,
            "divergence": self.ledger.as_dict() if self.ledger is not None else {"contract": "exact"},
            "parts": self.parts,
            "invariance": [c.as_dict() for c in self.invariance],
            "distribution": self.distribution.as_dict() if self.distribution is not None else None,
            "distribution_failed": self.distribution_failed or None,
            "bugs": [f.as_dict() for f in self.findings],
        }

    def text(self) -> str:
        s = self.settings
        lines = [
            f"melix-fsm verify: {s['model']} ({s['dtype']}, weights {s.get('weights', '?')}, logits in "
            f"{s['logits_dtype']}) on {s['device']}; "
            f"mlx {s['mlx']}, mlx-lm {s['mlx_lm']}; profile {s['profile']}, seed {s['seed']}",
            "",
            f"{'part':<34} {'tokens':>7} {'time':>7}  result",
        ]
        for name, part in self.parts.items():
            lines.append(f"{name:<34} {part['tokens']:>7} {part['seconds']:>6.1f}s  {part['result']}")
        lines.append("")
        if self.ledger is not None:
            lines += self.ledger.text_lines("divergences")
            for d in self.ledger.divergences[:5]:
                lines.append(f"  {d.text()}")
        else:
            lines.append("divergences: compared exactly (--exact: every differing token is a bug)")
        for case in self.invariance:
            lines.append(f"batch invariance, {case.name}: {case.verdict}")
        if self.distribution is not None:
            worst = min((min(p.p_value, p.z_p_value) for p in self.distribution.positions), default=1.0)
            verdict = "FAIL" if self.distribution_failed else "pass"
            lines.append(
                f"distribution: {verdict} ({self.distribution.draws} draws at T = 1, smallest p {worst:.3g}, "
                f"alpha {ALPHA})"
            )
        for i, f in enumerate(self.findings, 1):
            lines += ["", f"bug {i} ({f.part}): {f.error.prop} @ {f.error.where}", f"  {f.error.detail}"]
        if self.distribution_failed:
            lines += ["", f"bug ({'distribution'}): {self.distribution_failed}"]
        if self.receipt is not None and "error" in self.receipt:
            lines += ["", f"receipt: not resolved ({self.receipt['error']})"]
        elif self.receipt is not None:
            r = self.receipt
            lines += [
                "",
                f"receipt: mode {r['mode']}, method {r['resolved_method']}, "
                f"num_draft_tokens {r['num_draft_tokens']}, family {r['family']}"
                + (f", refused: {r['refusal_reason']}" if r.get("refusal_reason") else ""),
            ]
        lines += [f"promise: {self.promise()}", f"verdict: {'pass' if self.ok else 'FAIL'}"]
        return "\n".join(lines)


def environment() -> dict[str, str]:
    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"

    return {
        "device": f"{mx.default_device()} ({platform.system()} {platform.machine()})",
        "mlx": v("mlx"),
        "mlx_lm": v("mlx-lm"),
    }


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
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.decoding.generate import mtp_generate_step
    from melix_mlx.runtime.sampling import make_sampler
    from melix_mlx.tools.qa.probabilities import target_probabilities

    tell = progress or (lambda kind, value: None)
    seed = int(settings["seed"])
    mx.random.seed(seed)  # the sampled draws replay with the seed too
    top = min(int(settings["vocab_size"]), 1000) - 1
    report = VerifyReport(dict(settings), contract, judge.ledger if judge is not None else None)
    reference = memoized(mlx_greedy_reference(model, min_tokens=profile["max_tokens"]))

    def batched(temperature: float = 0.0, sizes: tuple[int, int] = (2, 3)) -> Any:
        return MTPBatchGenerator(
            model,
            head,
            num_draft_tokens=k,
            sampler=make_sampler(temp=temperature),
            prefill_batch_size=sizes[0],
            completion_batch_size=sizes[1],
        )

    def counted() -> int:
        return report.ledger.tokens if report.ledger is not None else 0

    def part(name: str, run: Callable[[], str]) -> None:
        tell("phase", name)
        t0, before = time.perf_counter(), counted()
        result = run()
        report.parts[name] = {
            "tokens": counted() - before,
            "seconds": time.perf_counter() - t0,
            "result": result,
        }

    def run_schedules(
        name: str, schedules: list[list[dict[str, Any]]], make: Callable[[], Any], **kw: Any
    ) -> str:
        failed = 0
        for schedule in schedules:
            err = replay_error(schedule, make, reference, judge=judge, **kw)
            if err is not None:
                failed += 1
                report.findings.append(Finding(name, err, schedule))
        near = report.ledger.count(NEAR_TIE) if report.ledger is not None else 0
        return f"{failed} bug(s)" if failed else ("pass" + (f", {near} near-tie(s) so far" if near else ""))

    schedules = batched_schedules(seed, top, profile["batches"], profile["max_tokens"], k)
    part("identity, batched", lambda: run_schedules("identity, batched", schedules, batched))

    def singles() -> str:
        rng = random.Random(seed + 1)
        out = []
        for depth in range(1, k + 1):
            requests = [
                {"prompt": _prompt(rng, top), "max_tokens": profile["max_tokens"], "stops": [], "options": {}}
                for _ in range(profile["singles"])
            ]

            def stream(depth: int = depth) -> Any:
                return lambda prompt, n: mtp_generate_step(
                    mx.array(prompt), model, head, max_tokens=n, num_draft_tokens=depth
                )

            out.append(
                run_schedules(
                    "identity, single",
                    [[{"op": "insert", "requests": requests}, {"op": "drain"}]],
                    stream,  # a fresh stream function (the generator) per schedule
                    surface="stream",
                )
            )
        return "; ".join(f"k={i + 1}: {r}" for i, r in enumerate(out))

    part("identity, single-sequence", singles)

    def invariance() -> str:
        rng = random.Random(seed + 2)
        prompt = _prompt(rng, top, 4, 12)
        neighbours = [_prompt(rng, top, 12, 24), _prompt(rng, top, 1, 3)]
        others = [_prompt(rng, top, 2, 6), _prompt(rng, top, 16, 24)]
        report.invariance = check_batch_invariance(
            lambda: batched(sizes=(4, 4)),
            prompt,
            neighbours,
            others,
            profile["invariance_tokens"],
            judge=judge,
            options={"num_draft_tokens": k},
            progress=progress,
        )
        for case in report.invariance:
            if case.error is not None:
                report.findings.append(Finding(f"batch invariance, {case.name}", case.error, case.schedule))
        verdicts = {c.verdict for c in report.invariance}
        return (
            "FAIL"
            if "FAIL" in verdicts
            else ("within contract" if "within contract" in verdicts else "bit-exact")
        )

    part("batch invariance (vs lone run)", invariance)

    def probes() -> str:
        options = {"num_draft_tokens": [k, max(1, k - 1), 1]}
        shapes = [s for _, s in probe_schedules(seed, tokens=(3, top), options=options)]
        if profile["probes"]:
            shapes = shapes[: profile["probes"]]
        return run_schedules("lifecycle probes", shapes, batched)

    part("lifecycle and edge-case probes", probes)

    def distribution() -> str:
        rng = random.Random(seed + 3)
        start = [rng.randint(3, top) for _ in range(2)]
        prompt = start + list(reference(tuple(start), 6))  # a context the model is confident in
        samples, crashes = draw_with_restarts(lambda: batched(1.0, (16, 64)), prompt, profile["draws"], 4)
        probs = target_probabilities(model, 1.0)
        result = measure_distribution(samples, probs, prompt, alpha=ALPHA, positions=4)
        result.crashes = len(crashes)
        report.distribution = result
        for err in crashes:
            report.findings.append(Finding("distribution", err, []))
        if crashes:
            return f"{len(crashes)} crash(es): inconclusive"
        try:
            check_distribution(samples, probs, prompt, alpha=ALPHA)
        except ConformanceError as err:
            report.distribution_failed = f"{err.prop}: {err.detail}"
            return "FAIL"
        return "pass"

    part(f"distribution ({profile['draws']} draws, T = 1)", distribution)
    return report


__all__ = ["PROFILES", "VerifyReport", "batched_schedules", "environment", "run_verify"]
