"""The divergence contract's mlx side: the reference's logits, their dtype, a simulated regime.

Rules of this module:
- `logits_of(model)`: the kit's `LogitsOf` (melix_fsm.testing.divergence): the logits the
  model gives for the next token after a context, from one forward of the whole context
  on a fresh cache, as float32 values (the contract reads margins of the reference's
  own logits; the forward is one row, as mlx-lm's decode is).
- `logits_dtype(model)`: the dtype the model's logits are computed in (one 1-token
  forward): float32, float16 or bfloat16 (quantized weights compute in their activation
  dtype, which is what a 4-bit model's logits come in).
- `contract_judge(model, ulps)`: a judge with a fresh ledger for that dtype.
- `SimulatedRounding`: MTPBatchGenerator whose verify rounds "differently": the verify's
  logits (a forward of more than one position per row) are perturbed by uniform noise of
  up to `ulps` units of eps(dtype) x max|z| per row (default 3: with the float32 output
  kept, no pair of tokens further apart than 6 < 8 ulps can swap, so only near-ties of
  the contract can flip). Prefill, plain steps and the head are untouched. The noise is
  seeded per generator (`seed`), so a schedule replays the same. It swaps the engine
  module's `forward_with_hidden` during its own step only, and restores it after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm.testing.divergence import EPS, DivergenceJudge, judge_for

DTYPES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def logits_of(model: Any) -> Any:
    def logits(context: tuple[int, ...]) -> Sequence[float]:
        out = model(mx.array([list(context)]), cache=make_prompt_cache(model))[0, -1]
        return out.astype(mx.float32).tolist()

    return logits


def logits_dtype(model: Any) -> str:
    out = model(mx.array([[1]]), cache=make_prompt_cache(model))
    name = DTYPES.get(out.dtype)
    if name is None:
        raise ValueError(f"the model's logits come in {out.dtype}, which the contract has no eps for")
    return name


def contract_judge(model: Any, ulps: float | None = None) -> DivergenceJudge:
    dtype = logits_dtype(model)
    return judge_for(logits_of(model), dtype) if ulps is None else judge_for(logits_of(model), dtype, ulps)


def perturbed_forward(forward: Any, dtype: str, ulps: float, key: list[mx.array]) -> Any:
    """`forward_with_hidden` whose multi-position logits carry the simulated rounding noise."""
    eps = EPS[dtype]

    def noisy(model: Any, inputs: mx.array, cache: Any = None, **kw: Any) -> tuple[mx.array, mx.array]:
        logits, hidden = forward(model, inputs, cache, **kw)
        if inputs.shape[1] < 2:  # a plain step: mlx-lm's own one-row arithmetic
            return logits, hidden
        key[0], sub = mx.random.split(key[0])
        z = logits.astype(mx.float32)
        scale = ulps * eps * mx.max(mx.abs(z), axis=-1, keepdims=True)
        return z + scale * mx.random.uniform(-1.0, 1.0, z.shape, key=sub), hidden

    return noisy


def simulated_rounding(
    dtype: str = "bfloat16", ulps: float = 3.0, seed: int = 0, base: type | None = None
) -> type:
    """An MTPBatchGenerator class (or `base`, a subclass of it) whose verify rounds differently."""
    import melix_mlx.runtime.engine as engine_mod
    from melix_mlx.batch_generator import MTPBatchGenerator

    class SimulatedRounding(base or MTPBatchGenerator):  # type: ignore[misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._noise_key = [mx.random.key(seed)]

        def _step(self) -> Any:
            original = engine_mod.forward_with_hidden
            engine_mod.forward_with_hidden = perturbed_forward(original, dtype, ulps, self._noise_key)
            try:
                return super()._step()
            finally:
                engine_mod.forward_with_hidden = original

    SimulatedRounding.__name__ = f"SimulatedRounding_{dtype}_{(base or MTPBatchGenerator).__name__}"
    return SimulatedRounding
