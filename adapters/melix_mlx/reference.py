"""mlx-lm reference decoding for the conformance kit (melix_fsm.testing).

Rules of this module:
- `greedy_reference(model)` is mlx-lm's own single-sequence greedy decoding
  (`mlx_lm.generate.generate_step`) of the same model object. Greedy decoding is
  prefix-consistent, so each prompt runs once, at the longest length asked so far, and
  shorter requests are answered by slicing.
- The kit reaches this module only when a caller leaves the reference to the default, so
  `import melix_fsm.testing` never imports mlx.
- No mlx-lm version floor: only `generate_step` is imported at module level (mlx-lm 0.31
  has it); `StopSequences` (0.32 only) is imported when a stop object is built, and its
  absence is a one-line error naming the 0.31 alternative.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

Reference = Callable[[tuple[int, ...], int], tuple[int, ...]]


def greedy_reference(model: Any, *, min_tokens: int = 10) -> Reference:
    """mlx-lm's greedy `generate_step` on `model`, memoized per prompt (see module rules)."""
    runs: dict[tuple[int, ...], tuple[int, ...]] = {}

    def reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        prompt = tuple(int(t) for t in prompt)
        known = runs.get(prompt, ())
        if len(known) < max_tokens:
            n = max(max_tokens, min_tokens, 2 * len(known))  # rerun rarely, and not much longer
            known = tuple(int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n))
            runs[prompt] = known
        return known[:max_tokens]

    return reference


def stop_sequences(stops: Sequence[Sequence[int]]) -> Any:
    """mlx-lm's `StopSequences` for one request (what 0.32's `BatchGenerator.insert` takes)."""
    try:
        from mlx_lm.generate import StopSequences
    except ImportError:
        raise ImportError(
            "this mlx-lm has no StopSequences (it is older than 0.32): a 0.31-style generator takes "
            "state_machines= (surface state-machines), or pass a stop builder (--stops / make_stops=)"
        ) from None
    return StopSequences([list(s) for s in stops] or None)
