"""The sidecar-pack validation contract: its checks, its report, where packs are found.

A sidecar pack is a directory holding only MTP head tensors (often beside a quantized
target whose own conversion dropped the head). It is admitted only by this contract;
no flag bypasses it.

Rules of this module:
- The contract is the ordered list `CHECKS`; each check passes, fails, or was not run
  because an earlier one failed. A pack is validated only when every check passed.
  What each check means:
    config        the pack's config (when it ships one) names the target's family and
                  agrees with the target on hidden size, vocabulary and head-layer count;
    keys          every head tensor the family's layout needs is present, nothing else;
    shapes        every tensor has the shape the target's config implies;
    dtypes        float tensors are float16/bfloat16/float32 (fp8 with its block scales
                  for DeepSeek), packed quantized weights uint32;
    quantization  quantized tensors are complete (weight, scales, biases) and their
                  bits / group size match what the pack's or the target's config declares;
    probe         one head forward on the target's hidden states for a short probe text
                  (the target's own greedy continuation) gives finite logits that agree
                  with the target's next-next token more often than chance (one-sided
                  binomial test, `PROBE_ALPHA`). A multi-layer pack is probed through
                  layer 0, the layer every cycle's first draft comes from.
- The checks run where the tensors are (melix_mlx.loading.sidecar); this module holds the data
  and the verdict, and no mlx. `melix_fsm.receipt.resolve(..., sidecar=report)` admits a
  validated pack and refuses any other as `unvalidated_sidecar`, naming the failed check.
- Packs are found by `--mtp-sidecar DIR` or by convention beside the target:
  `<target>/mtp/` or a sibling `<target>-mtp/` (`find_pack`).
"""

from __future__ import annotations

import enum
import math
from pathlib import Path

import msgspec

CHECKS = ("config", "keys", "shapes", "dtypes", "quantization", "probe")
PROBE_ALPHA = 1e-3  # chance must explain the probe's hits with probability below this
CONVENTION = ("mtp", "{name}-mtp")  # inside the target, or a sibling directory


class CheckStatus(enum.StrEnum):
    passed = "passed"
    failed = "failed"
    not_run = "not_run"  # an earlier check failed


class SidecarCheck(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    status: CheckStatus
    detail: str


class SidecarReport(msgspec.Struct, frozen=True, kw_only=True):
    """The contract's outcome for one pack, recorded in the receipt."""

    path: str
    validated: bool
    failed_check: str | None
    checks: list[SidecarCheck]
    files: list[str] = []
    tensor_count: int = 0  # head tensors the pack holds

    @property
    def failure(self) -> str | None:
        """``"check 'NAME' failed: DETAIL"`` for a pack that did not pass."""
        for check in self.checks:
            if check.status is CheckStatus.failed:
                return f"check {check.name!r} failed: {check.detail}"
        return None


def report(
    path: str | Path,
    results: dict[str, tuple[bool, str]],
    files: list[str] | None = None,
    tensor_count: int = 0,
) -> SidecarReport:
    """A report from ``{check: (passed, detail)}`` in contract order; checks after the first
    failure (or never run) are ``not_run``."""
    unknown = set(results) - set(CHECKS)
    if unknown:
        raise ValueError(f"not contract checks: {sorted(unknown)}")
    checks: list[SidecarCheck] = []
    failed: str | None = None
    for name in CHECKS:
        if failed is not None or name not in results:
            checks.append(SidecarCheck(name=name, status=CheckStatus.not_run, detail=""))
            continue
        ok, detail = results[name]
        checks.append(
            SidecarCheck(name=name, status=CheckStatus.passed if ok else CheckStatus.failed, detail=detail)
        )
        if not ok:
            failed = name
    validated = failed is None and all(c.status is CheckStatus.passed for c in checks)
    if failed is None and not validated:
        failed = next(c.name for c in checks if c.status is not CheckStatus.passed)
    return SidecarReport(
        path=str(path),
        validated=validated,
        failed_check=failed,
        checks=checks,
        files=files or [],
        tensor_count=tensor_count,
    )


def chance_p_value(hits: int, trials: int, chance: float) -> float:
    """P(at least ``hits`` successes in ``trials``) for a head guessing at rate ``chance``."""
    if hits <= 0:
        return 1.0
    return min(
        1.0,
        sum(math.comb(trials, h) * chance**h * (1 - chance) ** (trials - h) for h in range(hits, trials + 1)),
    )


def find_pack(target: str | Path) -> Path | None:
    """A pack beside ``target`` by convention (``<target>/mtp/``, ``<target>-mtp/``), or None."""
    target = Path(target)
    for pattern in CONVENTION:
        candidate = (
            target / pattern if "{name}" not in pattern else target.parent / pattern.format(name=target.name)
        )
        if candidate.is_dir() and any(candidate.glob("*.safetensors")):
            return candidate
    return None
