"""Malformed specs are refused at load time with a SpecError naming the offending entry.

Rules of this file:
- Each case edits a deep copy of the real spec/lifecycle.toml (parsed with tomllib), so
  it breaks exactly one rule and everything else stays valid.
- File-level cases (not TOML, not UTF-8, missing) go through `load_lifecycle(path)` on
  files under tmp_path; nothing here writes into the source tree.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from melix_fsm.errors import MelixError, SpecError
from melix_fsm.lifecycle import SPEC
from melix_fsm.spec import load_batch, load_lifecycle, parse_batch, parse_lifecycle, spec_dir

LIFECYCLE_PATH = spec_dir() / "lifecycle.toml"
BATCH_PATH = spec_dir() / "batch.toml"
REAL: dict[str, Any] = tomllib.loads(LIFECYCLE_PATH.read_text(encoding="utf-8"))
REAL_BATCH: dict[str, Any] = tomllib.loads(BATCH_PATH.read_text(encoding="utf-8"))

Edit = Callable[[dict[str, Any]], None]


def _transition(data: dict[str, Any], event: str) -> dict[str, Any]:
    return next(t for t in data["transitions"] if t["event"] == event)


def _index(data: dict[str, Any], event: str) -> int:
    return next(i for i, t in enumerate(data["transitions"]) if t["event"] == event)


def _unknown_source(d: dict[str, Any]) -> None:
    _transition(d, "verify")["from"] = ["drafting", "daydreaming"]


def _unknown_target(d: dict[str, Any]) -> None:
    _transition(d, "verify")["to"] = "nowhere"


def _unreachable(d: dict[str, Any]) -> None:
    d["states"]["orphan"] = {"doc": "Nothing leads here."}


def _duplicate_cell(d: dict[str, Any]) -> None:
    d["transitions"].append({"from": ["requested"], "event": "admit", "to": "refused"})


def _same_guard_twice(d: dict[str, Any]) -> None:
    for t in d["transitions"]:
        if t["event"] == "verified":
            t["guard"] = "all_accepted"


def _guard_on_one_side(d: dict[str, Any]) -> None:
    rolled = next(t for t in d["transitions"] if t.get("guard") == "!all_accepted")
    del rolled["guard"]


def _three_in_a_cell(d: dict[str, Any]) -> None:
    d["transitions"].append({"from": ["verifying"], "event": "verified", "to": "faulted"})


def _final_with_exit(d: dict[str, Any]) -> None:
    d["transitions"].append({"from": ["finished"], "event": "admit", "to": "admitted"})


def _missing_initial(d: dict[str, Any]) -> None:
    del d["initial"]


def _unknown_initial(d: dict[str, Any]) -> None:
    d["initial"] = "limbo"


def _final_initial(d: dict[str, Any]) -> None:
    d["initial"] = "finished"


def _unknown_event(d: dict[str, Any]) -> None:
    _transition(d, "verify")["event"] = "teleport"


def _unknown_guard(d: dict[str, Any]) -> None:
    rolled = next(t for t in d["transitions"] if t.get("guard") == "!all_accepted")
    rolled["guard"] = "!lucky"


def _empty_guard(d: dict[str, Any]) -> None:
    rolled = next(t for t in d["transitions"] if t.get("guard") == "!all_accepted")
    rolled["guard"] = "!"


def _unused_event(d: dict[str, Any]) -> None:
    d["events"]["nap"] = {"doc": "Declared, never used."}


def _unused_guard(d: dict[str, Any]) -> None:
    d["guards"]["lucky"] = {"doc": "Declared, never used."}


def _state_without_doc(d: dict[str, Any]) -> None:
    del d["states"]["verifying"]["doc"]


def _event_with_blank_doc(d: dict[str, Any]) -> None:
    d["events"]["verify"]["doc"] = "   "


def _guard_without_doc(d: dict[str, Any]) -> None:
    d["guards"]["all_accepted"] = {}


def _multiline_doc(d: dict[str, Any]) -> None:
    d["states"]["drafting"]["doc"] = "line one\nline two"


def _final_not_bool(d: dict[str, Any]) -> None:
    d["states"]["finished"]["final"] = "yes"


def _missing_schema(d: dict[str, Any]) -> None:
    del d["schema"]


def _no_transitions(d: dict[str, Any]) -> None:
    d["transitions"] = []


def _empty_from(d: dict[str, Any]) -> None:
    _transition(d, "verify")["from"] = []


def _no_states(d: dict[str, Any]) -> None:
    d["states"] = {}


# (case id, edit, expected entry (exact), a word the message must contain)
CASES: list[tuple[str, Edit, str, str]] = [
    ("unknown-source-state", _unknown_source, f"transitions[{_index(REAL, 'verify')}].from", "daydreaming"),
    ("unknown-target-state", _unknown_target, f"transitions[{_index(REAL, 'verify')}].to", "nowhere"),
    ("unreachable-state", _unreachable, "states.orphan", "unreachable"),
    ("duplicate-cell", _duplicate_cell, "transition (requested, admit)", "disjoint"),
    ("same-guard-twice", _same_guard_twice, "transition (verifying, verified)", "disjoint"),
    ("guard-on-one-side", _guard_on_one_side, "transition (verifying, verified)", "disjoint"),
    ("three-in-a-cell", _three_in_a_cell, "transition (verifying, verified)", "3 times"),
    ("final-with-outgoing", _final_with_exit, "states.finished", "final"),
    ("missing-initial", _missing_initial, "initial", "missing"),
    ("unknown-initial", _unknown_initial, "initial", "limbo"),
    ("final-initial", _final_initial, "initial", "final"),
    ("unknown-event", _unknown_event, f"transitions[{_index(REAL, 'verify')}].event", "teleport"),
    ("unknown-guard", _unknown_guard, "", "lucky"),
    ("empty-guard", _empty_guard, "", "guard"),
    ("unused-event", _unused_event, "events.nap", "no transition"),
    ("unused-guard", _unused_guard, "guards.lucky", "no transition"),
    ("state-without-doc", _state_without_doc, "states.verifying", "doc"),
    ("event-blank-doc", _event_with_blank_doc, "events.verify", "doc"),
    ("guard-without-doc", _guard_without_doc, "guards.all_accepted", "doc"),
    ("multiline-doc", _multiline_doc, "states.drafting", "one line"),
    ("final-not-bool", _final_not_bool, "states.finished.final", "true or false"),
    ("missing-schema", _missing_schema, "schema", "schema"),
    ("no-transitions", _no_transitions, "transitions", "empty"),
    ("empty-from", _empty_from, f"transitions[{_index(REAL, 'verify')}].from", "non-empty"),
    ("no-states", _no_states, "states", "empty"),
]


def test_real_spec_loads() -> None:
    spec = parse_lifecycle(copy.deepcopy(REAL), "real")
    assert spec.transitions == SPEC.transitions
    assert spec.initial == SPEC.initial and spec.finals == SPEC.finals


@pytest.mark.parametrize(("edit", "entry", "word"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_spec_is_refused(edit: Edit, entry: str, word: str) -> None:
    data = copy.deepcopy(REAL)
    edit(data)
    with pytest.raises(SpecError) as info:
        parse_lifecycle(data, "edited.toml")
    err = info.value
    assert err.path == "edited.toml"
    if entry:
        assert err.entry == entry, str(err)
    else:  # the guard cases: the offending transition, whichever index it has
        assert err.entry.startswith("transitions[") and err.entry.endswith(".guard"), str(err)
    assert word in str(err), str(err)
    assert isinstance(err, MelixError)


def test_edits_do_not_leak_into_the_real_copy() -> None:
    # Guards against a case mutating the shared REAL dict (which would hide other cases).
    assert parse_lifecycle(copy.deepcopy(REAL)).transitions == SPEC.transitions


def _write(tmp_path: Path, content: bytes, name: str = "lifecycle.toml") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_load_copy_of_real_file(tmp_path: Path) -> None:
    path = _write(tmp_path, LIFECYCLE_PATH.read_bytes())
    spec = load_lifecycle(path)
    assert spec.path == str(path)
    assert spec.transitions == SPEC.transitions


def test_load_not_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, b"schema = \n[states\n")
    with pytest.raises(SpecError) as info:
        load_lifecycle(path)
    assert info.value.entry == "toml" and info.value.path == str(path)


def test_load_not_utf8(tmp_path: Path) -> None:
    path = _write(tmp_path, LIFECYCLE_PATH.read_bytes().replace(b"sequence", b"s\xe9quence"))
    with pytest.raises(SpecError) as info:
        load_lifecycle(path)
    assert info.value.entry == "file" and "UTF-8" in info.value.problem


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_lifecycle(tmp_path / "absent.toml")
    assert info.value.entry == "file"


def test_load_malformed_file_names_entry(tmp_path: Path) -> None:
    text = LIFECYCLE_PATH.read_text(encoding="utf-8").replace('initial = "requested"', 'initial = "limbo"')
    with pytest.raises(SpecError) as info:
        load_lifecycle(_write(tmp_path, text.encode()))
    assert info.value.entry == "initial" and "limbo" in str(info.value)


# -- batch.toml ---------------------------------------------------------------------------


def test_real_batch_spec_loads() -> None:
    batch = load_batch(SPEC)
    assert set(batch.operations) >= {"extend", "filter", "step"}
    assert "atomic_step" in batch.invariants


def test_batch_unknown_lifecycle_event() -> None:
    data = copy.deepcopy(REAL_BATCH)
    data["operations"]["step"]["lifecycle_events"].append("teleport")
    with pytest.raises(SpecError) as info:
        parse_batch(data, SPEC, "batch.toml")
    assert info.value.entry == "operations.step.lifecycle_events" and "teleport" in str(info.value)


def test_batch_invariant_without_doc() -> None:
    data = copy.deepcopy(REAL_BATCH)
    data["invariants"]["unique_uids"] = {}
    with pytest.raises(SpecError) as info:
        parse_batch(data, SPEC, "batch.toml")
    assert info.value.entry == "invariants.unique_uids"


def test_batch_file_not_toml(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_batch(SPEC, _write(tmp_path, b"[operations", "batch.toml"))
    assert info.value.entry == "toml"
