"""Generator surfaces: the few calls the kit makes, adapted to each generator shape in use.

Rules of this module:
- The driver talks to a `Surface` only: `insert(specs) -> uids`, `step() -> [Emission]`,
  `remove(uids)`, and `report()` / `batch()` (None where the generator keeps none). Each
  adapter below lists, in its docstring, every call it makes on the generator, with the
  arguments and what it expects back; docs/conformance.md repeats that contract.
- `remove` is only ever called with uids that are still queued or generating: the kit
  never removes a request that finished or was removed already.
- Emissions are normalised here and nowhere else: a response's token is read from its
  `.token` attribute (or the first item of a tuple, for single-sequence iterators),
  never guessed from position in an object.
- `as_surface(generator, kind="auto")` picks the adapter: an object with `insert` and
  `next` is a batch generator; its `insert` signature decides the stop keyword
  (`stop_sequences=` for mlx-lm >= 0.32, `state_machines=` for the 0.31 style); a plain
  callable is a single-sequence stream. A wrong or undecidable shape is a `SurfaceError`
  (a usage error), never a silent guess.
- Pure core: no mlx. The default stop builders import mlx-lm lazily when called.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import MelixError
from .reference import mlx_stop_sequences

SURFACE_KINDS = ("auto", "batch", "state-machines", "stream")


class SurfaceError(MelixError, ValueError):
    """The generator's shape does not fit the surface asked for (a usage error)."""


@dataclass(frozen=True)
class Emission:
    """One token a request received in a step; `finish_reason` is set on its last token."""

    uid: Any
    token: int
    finish_reason: str | None


class Surface(Protocol):
    def insert(self, specs: Sequence[Any]) -> list[Any]: ...
    def step(self) -> list[Emission]: ...
    def remove(self, uids: Sequence[Any]) -> None: ...
    def report(self) -> Any: ...
    def batch(self) -> Any: ...


def _token(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        value = value[0]
    value = getattr(value, "token", value)
    if hasattr(value, "item"):  # a 0-d array
        value = value.item()
    return int(value)


def _options(specs: Sequence[Any]) -> dict[str, list[Any]]:
    """Per-request extra insert options, gathered as one list per keyword."""
    options: dict[str, list[Any]] = {}
    for spec in specs:
        for key, value in spec.options.items():
            options.setdefault(key, []).append(value)
    return options


class BatchSurface:
    """A continuous-batching generator shaped like mlx-lm's `BatchGenerator` (>= 0.32).

    Calls made:
    - `insert(prompts: list[list[int]], max_tokens=list[int], <stop_keyword>=list[obj],
      **options) -> list[uid]`: one uid per prompt, distinct, never reused. `obj` is
      `make_stops(stops)` for each request's stop sequences (token tuples); the stop
      keyword is left out when no request of the call has a stop sequence (unless `insert`
      requires it), and a stop-less request otherwise gets `make_stops([])` (the empty
      form).
    - `next() -> (prompt_responses, generation_responses)`: only the second item is read
      (a plain list of generation responses is accepted as well); each generation
      response has `.uid`, `.token` (int or 0-d array) and `.finish_reason` (None until
      the request's last token). Several responses per uid in one call are allowed
      (speculative decoding emits accepted drafts together).
    - `remove(uids: list[uid])`: uids still queued or generating, never ended ones.
    - `last_report` (optional attribute): a melix_fsm.report.StepReport after each
      `next()`; `batch` (optional): a melix_fsm.batch.Batch mirror of its rows.
    """

    stop_keyword = "stop_sequences"

    def __init__(self, generator: Any, make_stops: Callable[[Sequence[Sequence[int]]], Any] | None = None):
        self.gen = generator
        self.make_stops = make_stops or default_stop_sequences
        self.stops_required = _required(generator, self.stop_keyword)

    def insert(self, specs: Sequence[Any]) -> list[Any]:
        kwargs: dict[str, Any] = {"max_tokens": [s.max_tokens for s in specs], **_options(specs)}
        # no stops in the whole call: no stop object at all (the generator's own default), so
        # the kit never builds an object the target's version may reject
        if self.stops_required or any(s.stops for s in specs):
            kwargs[self.stop_keyword] = [self.make_stops(list(s.stops)) for s in specs]
        return list(self.gen.insert([list(s.prompt) for s in specs], **kwargs))

    def step(self) -> list[Emission]:
        result = self.gen.next()
        # (prompt_responses, generation_responses), or older generators' plain list of responses
        pair = isinstance(result, tuple) and len(result) == 2 and not hasattr(result, "uid")
        generation = result[1] if pair else result
        return [Emission(r.uid, _token(r.token), r.finish_reason) for r in generation]

    def remove(self, uids: Sequence[Any]) -> None:
        self.gen.remove(list(uids))

    def report(self) -> Any:
        return getattr(self.gen, "last_report", None)

    def batch(self) -> Any:
        return getattr(self.gen, "batch", None)


class StateMachineSurface(BatchSurface):
    """A 0.31-style batch generator: stops travel as `state_machines=` instead.

    Same calls as `BatchSurface`, except that `insert` takes `state_machines=[obj]`,
    `obj = make_stops(stops)`: by default mlx-lm 0.31's `SequenceStateMachine` whose only
    state ("normal") ends the sequence (transition to None) on any stop sequence, and
    `SequenceStateMachine()` (no transitions: 0.31.3 rejects `SequenceStateMachine(None)`)
    for a stop-less request.
    """

    stop_keyword = "state_machines"

    def __init__(self, generator: Any, make_stops: Callable[[Sequence[Sequence[int]]], Any] | None = None):
        super().__init__(generator, make_stops or default_state_machine)


def _required(generator: Any, keyword: str) -> bool:
    """Whether `generator.insert` needs `keyword` (it has no default there)."""
    try:
        param = inspect.signature(generator.insert).parameters.get(keyword)
    except (TypeError, ValueError, AttributeError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


_DRY = object()  # an iterator that has nothing more


@dataclass
class _Stream:
    uid: int
    prompt: list[int]
    max_tokens: int
    stops: tuple[tuple[int, ...], ...]
    tokens: Iterator[Any] | None = None
    ahead: Any = _DRY  # the next token, read one ahead so the last one carries its finish
    count: int = 0
    tail: tuple[int, ...] = ()


class StreamSurface:
    """A single-sequence, `stream_generate`-like callable, run one request after another.

    Calls made:
    - `stream(prompt: list[int], max_tokens: int) -> iterator`, once per request, on its
      first step. Each item is a token: an int, a 0-d array, a tuple whose first item is
      the token (`generate_step`'s `(token, logprobs)`), or an object with `.token`
      (`stream_generate`'s responses). The kit reads one item ahead (to mark the last
      token), never more than `max_tokens` items, applies the request's stop sequences
      itself (the stopping token is kept) and then closes the iterator (`.close()` when
      it has one). An iterator that ends early ends its request there.
    Each kit step advances every open request by one token; uids are insertion counts.
    """

    def __init__(self, stream: Callable[..., Any]):
        self.fn = stream
        self.rows: list[_Stream] = []
        self.next_uid = 0

    def insert(self, specs: Sequence[Any]) -> list[Any]:
        uids = []
        for spec in specs:
            self.rows.append(_Stream(self.next_uid, list(spec.prompt), spec.max_tokens, tuple(spec.stops)))
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def step(self) -> list[Emission]:
        out, done = [], []
        for row in self.rows:
            if row.tokens is None:
                row.tokens = iter(self.fn(row.prompt, row.max_tokens))
                row.ahead = self._read(row)
            if row.ahead is _DRY:  # nothing at all: the request ends without a token
                done.append(row)
                continue
            token, row.count = row.ahead, row.count + 1
            longest = max((len(s) for s in row.stops), default=0)
            row.tail = (row.tail + (token,))[-longest:] if longest else ()
            reason = None
            if any(s and row.tail[-len(s) :] == s for s in row.stops):
                reason = "stop"
            elif row.count >= row.max_tokens:
                reason = "length"
            else:
                row.ahead = self._read(row)
                if row.ahead is _DRY:
                    reason = "end"
            out.append(Emission(row.uid, token, reason))
            if reason:
                done.append(row)
        for row in done:
            self._close(row)
        return out

    def _read(self, row: _Stream) -> Any:
        try:
            return _token(next(row.tokens))  # type: ignore[arg-type]
        except StopIteration:
            return _DRY

    def remove(self, uids: Sequence[Any]) -> None:
        wanted = set(uids)
        for row in [r for r in self.rows if r.uid in wanted]:
            self._close(row)

    def _close(self, row: _Stream) -> None:
        self.rows = [r for r in self.rows if r is not row]
        close = getattr(row.tokens, "close", None)
        if close is not None:
            close()

    def report(self) -> Any:
        return None

    def batch(self) -> Any:
        return None


def surface_kind(generator: Any) -> str:
    """Which adapter `as_surface(generator)` picks (see the module rules)."""
    if hasattr(generator, "insert") and hasattr(generator, "next"):
        try:
            params = inspect.signature(generator.insert).parameters
        except (TypeError, ValueError):
            params = {}
        if "stop_sequences" in params:
            return "batch"
        if "state_machines" in params:
            return "state-machines"
        raise SurfaceError(
            f"{type(generator).__name__}.insert takes neither stop_sequences= (mlx-lm >= 0.32) nor "
            "state_machines= (0.31 style); pass the surface kind and a stop builder explicitly"
        )
    if callable(generator):
        return "stream"
    raise SurfaceError(
        f"a {type(generator).__name__} is no generator surface: it needs insert/next/remove "
        "(a batch generator) or must be callable (a single-sequence stream)"
    )


def as_surface(
    generator: Any,
    kind: str = "auto",
    make_stops: Callable[[Sequence[Sequence[int]]], Any] | None = None,
) -> Surface:
    """Wrap `generator` in the adapter for its surface (see the module rules)."""
    if kind not in SURFACE_KINDS:
        raise SurfaceError(f"unknown surface {kind!r}; choose one of {', '.join(SURFACE_KINDS)}")
    if kind == "auto":
        kind = surface_kind(generator)
    if kind == "batch":
        return BatchSurface(generator, make_stops)
    if kind == "state-machines":
        return StateMachineSurface(generator, make_stops)
    if not callable(generator):
        raise SurfaceError(f"the stream surface needs a callable, got a {type(generator).__name__}")
    return StreamSurface(generator)


def default_stop_sequences(stops: Sequence[Sequence[int]]) -> Any:
    """mlx-lm's `StopSequences` for one request (what 0.32's `BatchGenerator.insert` takes)."""
    return mlx_stop_sequences(stops)


def default_state_machine(stops: Sequence[Sequence[int]]) -> Any:
    """mlx-lm 0.31's `SequenceStateMachine` ending the sequence on any of `stops`."""
    generate = importlib.import_module("mlx_lm.generate")
    machine = getattr(generate, "SequenceStateMachine", None)
    if machine is None:
        raise SurfaceError(
            "this mlx-lm has no SequenceStateMachine (it is >= 0.32): pass make_stops= to build "
            "your generator's state machines"
        )
    edges = [(tuple(s), None) for s in stops if s]
    if not edges:
        return machine()  # the empty form: 0.31.3 rejects transitions=None
    return machine({"normal": edges}, initial="normal")
