"""The kit's requests: one as the kit asks for it, and the kit's view of it once inserted.

Rules of this module:
- A `RequestSpec` is plain data (it goes into a recorded schedule: `as_dict` /
  `from_dict` round-trip it), so `replay` re-runs a schedule without Hypothesis.
- A `Tracked` request moves through QUEUED -> LIVE -> FINISHED or REMOVED; the driver
  (melix_fsm.testing.driver) owns those moves and every check on its tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .divergence import Divergence

QUEUED, LIVE, FINISHED, REMOVED = "queued", "live", "finished", "removed"


@dataclass(frozen=True)
class RequestSpec:
    """One request as the kit asks for it (plain data: it goes into the schedule)."""

    prompt: tuple[int, ...]
    max_tokens: int
    stops: tuple[tuple[int, ...], ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "stops": [list(s) for s in self.stops],
            "options": dict(self.options),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestSpec:
        return cls(
            prompt=tuple(d["prompt"]),
            max_tokens=int(d["max_tokens"]),
            stops=tuple(tuple(s) for s in d.get("stops", ())),
            options=dict(d.get("options", {})),
        )


@dataclass
class Tracked:
    """The kit's view of one inserted request."""

    index: int
    spec: RequestSpec
    expected: tuple[int, ...]
    uid: Any = None
    status: str = QUEUED
    got: list[int] = field(default_factory=list)
    tainted: bool = False  # hit a known (skipped) wrong-tokens bug: its tokens go unchecked
    ragged: bool = False  # got its first token with a prompt of another length (left padding)
    joined_running: bool = False  # got its first token while another request was generating
    divergence: Divergence | None = None  # a judged near-tie that ended the checks of its tokens
