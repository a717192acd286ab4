"""Load and validate the spec files: every machine (spec/<name>.toml, see `MACHINES`) and
the batch composition (spec/batch.toml).

Rules of this module:
- It only reads and checks; it builds no machine. `melix_fsm.lifecycle` compiles the
  lifecycle into its runtime table, `melix_fsm.machine` compiles any other machine the
  same way, `melix_fsm.oracle` / `melix_fsm.machine.build_oracle` into oracle classes.
- Every machine file has one schema: states, events, optional guards, transitions, an
  initial state (the lifecycle's header lists the rules the loader enforces).
- A malformed spec is refused at load time with a `SpecError` naming the offending
  entry; a half-valid spec is never returned.
- The packaged copy (`melix_fsm/_spec`, written into wheels) wins over the source
  tree's `spec/`, so an installed package and a checkout read the same files.
"""

from __future__ import annotations

import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SpecError

SELF_LOOP = "="  # a transition target meaning "stay in the source state"


@dataclass(frozen=True)
class StateSpec:
    name: str
    doc: str
    final: bool


@dataclass(frozen=True)
class TransitionSpec:
    source: str
    event: str
    target: str
    guard: str | None  # guard name without the negation mark
    negated: bool  # True for "!guard"

    @property
    def guard_label(self) -> str:
        if self.guard is None:
            return ""
        return ("!" if self.negated else "") + self.guard


@dataclass(frozen=True)
class MachineSpec:
    path: str
    schema: str
    initial: str
    states: dict[str, StateSpec]
    events: dict[str, str]  # name -> doc
    guards: dict[str, str]  # name -> doc
    transitions: tuple[TransitionSpec, ...]
    title: str = ""  # the heading of the machine's page (optional `title` in the file)
    doc: str = ""  # one paragraph on what the machine decides (optional `doc` in the file)

    @property
    def name(self) -> str:
        """The machine's name: its file's stem (spec/controller.toml -> "controller")."""
        return self.path.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".toml")

    @property
    def finals(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states.values() if s.final)


LifecycleSpec = MachineSpec  # the lifecycle was the first machine; the name stays for callers

# Every machine the product specifies, in reading order (spec/<name>.toml each).
MACHINES: tuple[str, ...] = ("lifecycle", "controller", "depth", "pipeline", "request")


@dataclass(frozen=True)
class OperationSpec:
    name: str
    doc: str
    lifecycle_events: tuple[str, ...]


@dataclass(frozen=True)
class BatchSpec:
    path: str
    schema: str
    operations: dict[str, OperationSpec]
    invariants: dict[str, str]  # name -> doc


def spec_dir() -> Path:
    """The directory holding the spec files (packaged copy first, then the source tree)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_spec", here.parent / "spec"):
        if (candidate / "lifecycle.toml").is_file():
            return candidate
    raise SpecError(str(here), "spec directory", "neither melix_fsm/_spec nor spec/ exists")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(str(path), "file", f"cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SpecError(str(path), "file", "is not UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(path), "toml", str(exc)) from None


def _doc(path: str, entry: str, table: Any) -> str:
    if not isinstance(table, dict):
        raise SpecError(path, entry, "must be a table")
    doc = table.get("doc")
    if not isinstance(doc, str) or not doc.strip():
        raise SpecError(path, entry, "needs a one-line doc string")
    if "\n" in doc.strip():
        raise SpecError(path, entry, "doc must be one line")
    return doc.strip()


def _named_tables(path: str, data: dict[str, Any], key: str) -> dict[str, Any]:
    tables = data.get(key)
    if not isinstance(tables, dict) or not tables:
        raise SpecError(path, key, "missing or empty")
    return tables


def parse_machine(data: dict[str, Any], path: str = "<machine>") -> MachineSpec:
    """Validate a parsed machine document; raise SpecError naming the first problem."""
    schema = data.get("schema")
    if not isinstance(schema, str):
        raise SpecError(path, "schema", "missing schema id string")

    states: dict[str, StateSpec] = {}
    for name, table in _named_tables(path, data, "states").items():
        doc = _doc(path, f"states.{name}", table)
        final = table.get("final", False)
        if not isinstance(final, bool):
            raise SpecError(path, f"states.{name}.final", "must be true or false")
        states[name] = StateSpec(name, doc, final)

    events = {
        name: _doc(path, f"events.{name}", table)
        for name, table in _named_tables(path, data, "events").items()
    }
    guards = {name: _doc(path, f"guards.{name}", table) for name, table in (data.get("guards") or {}).items()}

    initial = data.get("initial")
    if not isinstance(initial, str):
        raise SpecError(path, "initial", "missing initial state")
    if initial not in states:
        raise SpecError(path, "initial", f"names unknown state {initial!r}")
    if states[initial].final:
        raise SpecError(path, "initial", f"initial state {initial!r} cannot be final")

    raw = data.get("transitions")
    if not isinstance(raw, list) or not raw:
        raise SpecError(path, "transitions", "missing or empty")
    transitions: list[TransitionSpec] = []
    for i, entry in enumerate(raw):
        transitions.extend(_parse_transition(path, i, entry, states, events, guards))

    _check_cells(path, transitions)
    _check_finals(path, transitions, states)
    _check_reachable(path, transitions, states, initial)
    used_events = {t.event for t in transitions}
    for name in events:
        if name not in used_events:
            raise SpecError(path, f"events.{name}", "is declared but no transition uses it")
    used_guards = {t.guard for t in transitions if t.guard}
    for name in guards:
        if name not in used_guards:
            raise SpecError(path, f"guards.{name}", "is declared but no transition uses it")

    title, doc = data.get("title", ""), data.get("doc", "")
    if not isinstance(title, str) or not isinstance(doc, str):
        raise SpecError(path, "title/doc", "must be strings")
    return MachineSpec(
        path, schema, initial, states, events, guards, tuple(transitions),
        title=title.strip(), doc=" ".join(doc.split()),
    )


def parse_lifecycle(data: dict[str, Any], path: str = "<lifecycle>") -> MachineSpec:
    """Validate a parsed lifecycle document (any machine document: one schema)."""
    return parse_machine(data, path)


def _parse_transition(
    path: str,
    index: int,
    entry: Any,
    states: dict[str, StateSpec],
    events: dict[str, str],
    guards: dict[str, str],
) -> list[TransitionSpec]:
    where = f"transitions[{index}]"
    if not isinstance(entry, dict):
        raise SpecError(path, where, "must be a table")
    sources = entry.get("from")
    if isinstance(sources, str):
        sources = [sources]
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) for s in sources):
        raise SpecError(path, f"{where}.from", "must be a state name or a non-empty list of them")
    event = entry.get("event")
    if event not in events:
        raise SpecError(path, f"{where}.event", f"names unknown event {event!r}")
    target = entry.get("to")
    if not isinstance(target, str) or (target != SELF_LOOP and target not in states):
        raise SpecError(path, f"{where}.to", f"names unknown state {target!r}")
    guard_text = entry.get("guard")
    guard: str | None = None
    negated = False
    if guard_text is not None:
        if not isinstance(guard_text, str) or not guard_text.lstrip("!"):
            raise SpecError(path, f"{where}.guard", "must be a guard name, optionally prefixed by !")
        negated = guard_text.startswith("!")
        guard = guard_text.lstrip("!")
        if guard not in guards:
            raise SpecError(path, f"{where}.guard", f"names unknown guard {guard!r}")
    out = []
    for source in sources:
        if source not in states:
            raise SpecError(path, f"{where}.from", f"names unknown state {source!r}")
        resolved = source if target == SELF_LOOP else target
        out.append(TransitionSpec(source, event, resolved, guard, negated))
    return out


def _check_cells(path: str, transitions: list[TransitionSpec]) -> None:
    """A (state, event) cell holds one transition, or two with guards G and !G."""
    cells: dict[tuple[str, str], list[TransitionSpec]] = {}
    for t in transitions:
        cells.setdefault((t.source, t.event), []).append(t)
    for (source, event), group in cells.items():
        if len(group) == 1:
            continue
        disjoint = (
            len(group) == 2
            and group[0].guard is not None
            and group[0].guard == group[1].guard
            and group[0].negated != group[1].negated
        )
        if not disjoint:
            labels = ", ".join(repr(t.guard_label or "<no guard>") for t in group)
            raise SpecError(
                path,
                f"transition ({source}, {event})",
                f"appears {len(group)} times without disjoint guards ({labels})",
            )


def _check_finals(path: str, transitions: list[TransitionSpec], states: dict[str, StateSpec]) -> None:
    for t in transitions:
        if states[t.source].final:
            raise SpecError(
                path, f"states.{t.source}", f"is final but has an outgoing transition on {t.event!r}"
            )


def _check_reachable(
    path: str, transitions: list[TransitionSpec], states: dict[str, StateSpec], initial: str
) -> None:
    seen = {initial}
    queue = deque([initial])
    while queue:
        current = queue.popleft()
        for t in transitions:
            if t.source == current and t.target not in seen:
                seen.add(t.target)
                queue.append(t.target)
    for name in states:
        if name not in seen:
            raise SpecError(path, f"states.{name}", f"is unreachable from {initial!r}")


def parse_batch(data: dict[str, Any], lifecycle: LifecycleSpec, path: str = "<batch>") -> BatchSpec:
    schema = data.get("schema")
    if not isinstance(schema, str):
        raise SpecError(path, "schema", "missing schema id string")
    operations: dict[str, OperationSpec] = {}
    for name, table in _named_tables(path, data, "operations").items():
        doc = _doc(path, f"operations.{name}", table)
        evs = table.get("lifecycle_events", [])
        if not isinstance(evs, list):
            raise SpecError(path, f"operations.{name}.lifecycle_events", "must be a list")
        for ev in evs:
            if ev not in lifecycle.events:
                raise SpecError(path, f"operations.{name}.lifecycle_events", f"names unknown event {ev!r}")
        operations[name] = OperationSpec(name, doc, tuple(evs))
    invariants = {
        name: _doc(path, f"invariants.{name}", table)
        for name, table in _named_tables(path, data, "invariants").items()
    }
    return BatchSpec(path, schema, operations, invariants)


def load_lifecycle(path: Path | None = None) -> MachineSpec:
    path = path or spec_dir() / "lifecycle.toml"
    return parse_machine(read_toml(path), str(path))


def load_machine(name: str, path: Path | None = None) -> MachineSpec:
    """The machine spec/<name>.toml (or `path`), validated."""
    if path is None and name not in MACHINES:
        raise SpecError(name, "machine", f"is not one of the specified machines {list(MACHINES)}")
    path = path or spec_dir() / f"{name}.toml"
    return parse_machine(read_toml(path), str(path))


def load_batch(lifecycle: LifecycleSpec, path: Path | None = None) -> BatchSpec:
    path = path or spec_dir() / "batch.toml"
    return parse_batch(read_toml(path), lifecycle, str(path))
