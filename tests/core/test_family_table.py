"""The docs' family table is read from the registry: one row per family, nothing invented.

Each row must say what the spec says of its family: a runnable family's head layout and
each cache kind's rollback strategy, a refused family's typed reason and message, a cache
kind a batch cannot hold as its typed refusal, and only the efficiency figures passed in.
"""

from __future__ import annotations

import msgspec

from melix_fsm.family_table import batched, families_table, family_row
from melix_fsm.reasons import RefusalReason
from melix_fsm.registry import Support, Unmergeable, registry


def _rows(table: str) -> dict[str, str]:
    rows = {}
    for line in table.splitlines()[2:]:
        name = line.split("**")[1]
        rows[name] = line
    return rows


def test_every_family_has_exactly_one_row() -> None:
    rows = _rows(families_table())
    assert sorted(rows) == sorted(registry().families)


def test_a_runnable_row_carries_its_layout_and_strategies() -> None:
    reg = registry()
    runnable = [f for f in reg.families.values() if f.support is Support.mtp]
    assert runnable
    rows = _rows(families_table())
    for fam in runnable:
        row = rows[fam.name]
        assert fam.weights is not None and f"`{fam.weights.layer}`" in row
        for kind in fam.cache_kinds:
            strategy = reg.cells[(kind, False, False)].strategy
            assert f"{kind}: `{strategy}`" in row, (fam.name, kind)
        assert "| runs |" in row


def test_a_refused_row_carries_its_reason_and_message() -> None:
    reg = registry()
    fam = next(iter(reg.families.values()))
    refused = msgspec.structs.replace(
        fam, support=Support.refused, refusal=RefusalReason.unsupported_model, message="no head here"
    )
    row = family_row(refused, reg, {})
    assert "refused (`unsupported_model`): no head here" in row
    assert row.count("| - |") >= 2  # no layout, no efficiency claimed for it


def test_an_unmergeable_kind_is_reported_with_its_refusal() -> None:
    reg = registry()
    fam = next(f for f in reg.families.values() if f.support is Support.mtp)
    kind = fam.cache_kinds[0]
    blocked = msgspec.structs.replace(
        reg,
        unmergeable={
            kind: Unmergeable(kind=kind, refusal=RefusalReason.unsupported_cache_sharing, message="x")
        },
    )
    assert batched(fam, blocked) == "one sequence at a time (unsupported_cache_sharing)"
    assert "single-sequence" in family_row(fam, blocked, {})


def test_efficiency_comes_only_from_the_caller() -> None:
    reg = registry()
    fam = next(f for f in reg.families.values() if f.support is Support.mtp)
    assert "not measured" in family_row(fam, reg, {})
    assert "| 0.93 / 0.91 |" in family_row(fam, reg, {fam.name: "0.93 / 0.91"})


def test_every_family_names_what_people_run() -> None:
    missing = [name for name, fam in registry().families.items() if not fam.runs.strip()]
    assert not missing, f"families.toml entries without runs = ...: {missing}"
