"""Reference decoders and the default stop-sequence builder for the conformance kit.

Rules of this module:
- A reference decoder is any callable `(prompt: tuple[int, ...], max_tokens: int) ->
  tuple[int, ...]`: the tokens the generator under test must produce for that request
  (the kit cuts them at the request's stop sequences itself). It must be deterministic.
- The defaults use mlx-lm, imported inside the functions only: `import melix_fsm.testing`
  never imports mlx, so the core and its tests run where mlx is not installed.
- `mlx_greedy_reference(model)` is mlx-lm's own single-sequence greedy decoding
  (`mlx_lm.generate.generate_step`) of the same model object. Greedy decoding is
  prefix-consistent, so it runs each prompt once, at the longest length asked so far, and
  answers shorter requests by slicing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Reference = Callable[[tuple[int, ...], int], tuple[int, ...]]


def mlx_greedy_reference(model: Any, *, min_tokens: int = 10) -> Reference:
    """mlx-lm's greedy `generate_step` on `model`, memoized per prompt (see module rules)."""
    runs: dict[tuple[int, ...], tuple[int, ...]] = {}

    def reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        import mlx.core as mx  # lazy: the kit must import without mlx
        from mlx_lm.generate import generate_step

        prompt = tuple(int(t) for t in prompt)
        known = runs.get(prompt, ())
        if len(known) < max_tokens:
            n = max(max_tokens, min_tokens, 2 * len(known))  # rerun rarely, and not much longer
            known = tuple(int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n))
            runs[prompt] = known
        return known[:max_tokens]

    return reference


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
    from mlx_lm.generate import StopSequences  # lazy, as above

    return StopSequences([list(s) for s in stops] or None)


def cut_at_stop(tokens: Sequence[int], stops: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """mlx-lm's semantics: generation ends on (and includes) the token completing a stop sequence."""
    tokens = tuple(tokens)
    for end in range(len(tokens)):
        for stop in stops:
            n = len(stop)
            if n and end + 1 >= n and tokens[end + 1 - n : end + 1] == tuple(stop):
                return tokens[: end + 1]
    return tokens
