"""A decode's run statistics as one typed, versioned record: what `response.stats` is.

Rules of this module:
- `GenerationStats` is the one shape of the statistics the library hands out
  (`mtp_stream_generate`'s responses, `MTPBatchGenerator`'s finishing responses), that
  `melix-fsm generate --json` prints under "stats", and that the server's `usage`
  (melix_mlx.serve.usage) reads: built once, read three ways, so they cannot disagree.
- Built from the decoders' plain data (`GenerationStats.of`): the lifecycle counters
  (melix_fsm.counters) with their derived figures, the decoder's forward counts, the
  refusal or fault, and the live controller's block (`PolicyStats`). Fields the batch
  path does not track (forward counts per row, the policy block) are None there.
- Versioned like the receipt: `schema` is STATS_SCHEMA_ID, `spec/stats.schema.json` is
  rebuilt by `schema_json()` and a test fails when it is stale. Changing a field means
  bumping STATS_SCHEMA_ID (docs/api/stability.md).
- Read access by key (`stats["accepted"]`, `stats.get("policy")`) stays, as the dict the
  responses carried before; `to_dict()` / `to_json()` give plain data. No mlx import.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from .policy.live_types import LiveCounters
from .spec import spec_dir

STATS_SCHEMA_ID = "melix-fsm/stats/1"


class _Record(msgspec.Struct, kw_only=True):
    """Key access and plain-data views shared by the stats records."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.__struct_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.__struct_fields__ else default

    def __contains__(self, key: object) -> bool:
        return key in self.__struct_fields__

    def keys(self) -> tuple[str, ...]:
        return self.__struct_fields__

    def __iter__(self) -> Iterator[str]:
        return iter(self.__struct_fields__)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (nested records become dicts)."""
        return msgspec.to_builtins(self)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)


class PolicyStats(LiveCounters, _Record, kw_only=True):
    """The live controller's block (melix_fsm.policy.controller.LiveController.summary)."""

    policy: str  # auto | force_on | force_off
    state: str  # the controller's mode (spec/controller.toml)
    speculating: bool
    disabled_reason: str | None = None
    prompt_acceptance: float | None = None  # what the sampled prompts scored before the first step
    ema_acceptance: float | None = None
    per_position_acceptance: list[float] = msgspec.field(default_factory=list)
    plain_rate: float | None = None
    measured_speedup: float | None = None
    predicted_speedup: float | None = None
    source: str = ""
    depth_reason: str = ""
    depth: str = "fixed"  # fixed | auto
    k: int = 1
    k_chosen: int = 1
    k_max: int = 1
    depth_explorations: int = 0
    depth_changes: int = 0
    rates_per_k: dict[str, float] = msgspec.field(default_factory=dict)


class GenerationStats(_Record, kw_only=True):
    """One decode's statistics; see the module rules."""

    schema: str = STATS_SCHEMA_ID
    # lifecycle counters (melix_fsm.counters.Counters) and their derived figures
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    discarded: int = 0
    pending: int = 0
    cycles: int = 0
    rollbacks: int = 0
    plain_steps: int = 0
    suspended_steps: int = 0
    suspensions: int = 0
    resumptions: int = 0
    faults: int = 0
    emitted: int = 0
    position_proposed: list[int] = msgspec.field(default_factory=list)
    position_accepted: list[int] = msgspec.field(default_factory=list)
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] = msgspec.field(default_factory=list)
    # the row
    state: str  # its lifecycle state (spec/lifecycle.toml)
    refusal: str | None = None  # "<reason>: <message>" when it decoded plainly by refusal
    refusal_reason: str | None = None  # the typed reason (melix_fsm.reasons.RefusalReason)
    fault: str | None = None
    # the single-sequence decoder's forward counts (None on a batch row)
    target_forwards: int | None = None
    replay_forwards: int | None = None
    head_forwards: int | None = None
    abandoned_steps: int | None = None
    policy: PolicyStats | None = None  # the live controller's block; None without one

    @classmethod
    def of(cls, data: dict[str, Any]) -> GenerationStats:
        """The record of a decoder's plain data (a test keeps its keys and the fields equal)."""
        return msgspec.convert(data, cls, strict=False)

    @property
    def speculated(self) -> bool:
        """Did any draft get verified in this decode?"""
        return self.cycles > 0


def schema_json() -> bytes:
    """The statistics' JSON Schema, as committed in spec/stats.schema.json."""
    schema = msgspec.json.schema(GenerationStats)
    schema = {"$id": STATS_SCHEMA_ID, "title": "melix-fsm run statistics", **schema}
    return msgspec.json.format(msgspec.json.encode(schema), indent=2) + b"\n"


def schema_path() -> Path:
    return spec_dir() / "stats.schema.json"
