"""Reference decoders and the default stop-sequence builder for the conformance kit.

Rules of this module:
- A reference decoder is any callable `(prompt: tuple[int, ...], max_tokens: int) ->
  tuple[int, ...]`: the tokens the generator under test must produce for that request
  (the kit cuts them at the request's stop sequences itself). It must be deterministic.
- The defaults are mlx-lm's own greedy decoding and stop sequences, provided by the
  package registered under the `melix_fsm.kit_defaults` entry point (the mlx adapter's
  melix_mlx.reference) and loaded only when called: `import melix_fsm.testing` never
  imports mlx, and the core names no adapter module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError

Reference = Callable[[tuple[int, ...], int], tuple[int, ...]]


DEFAULTS_GROUP = "melix_fsm.kit_defaults"


def _mlx_reference_module() -> Any:
    """The installed provider of the kit's defaults (first entry point by name)."""
    found = sorted(entry_points(group=DEFAULTS_GROUP), key=lambda e: e.name)
    if not found:
        raise ConfigError(
            "reference",
            f"no {DEFAULTS_GROUP!r} provider is installed: pass a reference decoder "
            "and stop builder, or install melix-fsm with its mlx extra",
        )
    return found[0].load()


def mlx_greedy_reference(model: Any, *, min_tokens: int = 10) -> Reference:
    """mlx-lm's greedy `generate_step` on `model`, memoized per prompt."""
    return _mlx_reference_module().greedy_reference(model, min_tokens=min_tokens)


def memoized(reference: Reference) -> Reference:
    """Cache a reference decoder's answers per (prompt, max_tokens)."""
    answers: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}

    def cached(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        key = (tuple(prompt), max_tokens)
        if key not in answers:
            answers[key] = tuple(int(t) for t in reference(key[0], max_tokens))
        return answers[key]

    cached.__wrapped__ = reference  # type: ignore[attr-defined]
    return cached


def mlx_stop_sequences(stops: Sequence[Sequence[int]]) -> Any:
    """mlx-lm's `StopSequences` for one request (what `BatchGenerator.insert` takes)."""
    return _mlx_reference_module().stop_sequences(stops)


def cut_at_stop(tokens: Sequence[int], stops: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """mlx-lm's semantics: generation ends on (and includes) the token completing a stop sequence."""
    tokens = tuple(tokens)
    for end in range(len(tokens)):
        for stop in stops:
            n = len(stop)
            if n and end + 1 >= n and tokens[end + 1 - n : end + 1] == tuple(stop):
                return tokens[: end + 1]
    return tokens
