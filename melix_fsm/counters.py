"""Speculation counters, per row and per batch.

Rules of this module:
- Counters change only as effects of lifecycle transitions (melix_fsm.lifecycle); nothing
  else writes them, so they always agree with the events a row went through.
- Derived figures (acceptance rate, mean acceptance length, per-position acceptance) are
  computed, never stored, so they cannot drift from the raw counts.
- `Counters` is a msgspec Struct: cheap to update on the hot path, and it serialises as is
  into receipts, responses and benchmark JSON.
"""

from __future__ import annotations

import msgspec


class Counters(msgspec.Struct, kw_only=True):
    """Raw speculation counts of one row, or summed over many."""

    proposed: int = 0  # draft tokens the head proposed
    accepted: int = 0  # draft tokens a verify accepted (and that were emitted)
    rejected: int = 0  # draft tokens a verify rejected (rolled back, never emitted)
    discarded: int = 0  # draft tokens dropped unverified by fault or finish
    pending: int = 0  # draft tokens proposed and not yet verified
    cycles: int = 0  # verify forwards (draft -> verify -> verified)
    rollbacks: int = 0  # cycles that rejected at least one draft
    plain_steps: int = 0  # tokens emitted by plain decode
    suspended_steps: int = 0  # plain steps taken while suspended
    suspensions: int = 0
    resumptions: int = 0
    faults: int = 0
    emitted: int = 0  # tokens emitted by decode steps (the prefill's first token is not one)
    # position p counts the cycles whose draft p was proposed / accepted
    position_proposed: list[int] = msgspec.field(default_factory=list)
    position_accepted: list[int] = msgspec.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over verified drafts; None before the first verify."""
        verified = self.accepted + self.rejected
        return self.accepted / verified if verified else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify cycle, bonus token included (tau in the literature)."""
        return (self.accepted + self.cycles) / self.cycles if self.cycles else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """For each draft position, the fraction of cycles proposing it that accepted it."""
        accepted = self.position_accepted + [0] * (len(self.position_proposed) - len(self.position_accepted))
        return [a / p if p else 0.0 for a, p in zip(accepted, self.position_proposed)]

    def add(self, other: Counters) -> None:
        """Add another row's counts into this one (batch totals, retired rows)."""
        for name in _SCALARS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        _add_lists(self.position_proposed, other.position_proposed)
        _add_lists(self.position_accepted, other.position_accepted)

    def copy(self) -> Counters:
        """An independent copy (reports and snapshots must not alias live counters)."""
        out = Counters()
        out.add(self)
        return out

    def summary(self) -> dict[str, object]:
        """The raw counts plus the derived figures, as plain data."""
        out = msgspec.structs.asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["per_position_acceptance"] = self.per_position_acceptance
        return out


_SCALARS = tuple(name for name in Counters.__struct_fields__ if not name.startswith("position_"))


def _add_lists(into: list[int], other: list[int]) -> None:
    if len(into) < len(other):
        into.extend([0] * (len(other) - len(into)))
    for i, value in enumerate(other):
        into[i] += value


def total(parts: list[Counters]) -> Counters:
    out = Counters()
    for part in parts:
        out.add(part)
    return out
