"""The report of `melix-fsm verify` (melix_mlx.tools.qa.verify runs the parts).

Rules of this module:
- Plain data: `as_dict` is the JSON to attach to a bug; `text()` the printed summary: the
  verdict, the divergence rate with margins, and the promise this run supports on this
  model, dtype and device, beside what the receipt resolves to.
- A `Finding` is one bug with the schedule that replays it.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx

from melix_fsm.testing.divergence import DivergenceLedger, RoundingContract
from melix_fsm.testing.invariance import CaseResult
from melix_fsm.testing.mirror import ConformanceError

ALPHA = 1e-3  # the distribution tests' significance level (the kit's G-test and mean-probability test)


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
