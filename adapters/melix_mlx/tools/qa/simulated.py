"""A simulated rounding regime for any `melix-fsm qa` target (`--simulate-rounding DTYPE`).

Rules of this module:
- Why: this CPU's kernels give a multi-row forward the same sums as a one-row decode, so
  the divergence contract never has anything to judge here. On GPUs the kernel depends on
  the row count and near-ties can flip. The regime stands in for that: the target's
  forwards round "differently" by up to `ulps` (default 3) units of eps(DTYPE) x max|z|,
  uniform noise on the logits, seeded per generator (so a schedule replays the same).
  3 ulps of noise moves no pair of tokens further apart than 6 < 8 ulps (the contract's
  bound), so only near-ties can flip: a correct target must come out with zero bugs,
  and a planted bug must still come out as a bug.
- Which forwards: the `melix` built-in (melix's `MTPBatchGenerator`, which reads the
  model's inner modules, not its `__call__`) gets melix_mlx.tools.qa.margins.simulated_rounding:
  its verify (more than one position per row) is perturbed, its plain steps are not.
  Every other target gets the model behind `NoisyModel`, whose forwards are perturbed
  unless they are one row of one token (mlx-lm's own decode arithmetic; a batched step
  is what a GPU kernel choice changes). The reference and the judge keep the plain model.
- A factory that does not take the kit's `model` (one that loads its own from the
  checkpoint) cannot be put under the regime: a `TargetError`, never a silent no-op.
- The judge of such a run follows the contract of DTYPE, whatever the model's own logits
  dtype (float32 weights under a bfloat16 regime are judged as bfloat16).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from melix_fsm.testing.divergence import EPS

from .margins import simulated_rounding
from .targets import KEYWORDS, Target, TargetError

DEFAULT_ULPS = 3.0


class NoisyModel:
    """A model whose forwards other than one row of one token carry the regime's noise."""

    def __init__(self, model: Any, dtype: str, ulps: float = DEFAULT_ULPS, seed: int = 0) -> None:
        self._model = model
        self._eps = EPS[dtype]
        self._ulps = ulps
        self._key = mx.random.key(seed)

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args, ...: the model's own
        return getattr(self._model, name)

    def __call__(self, inputs: mx.array, *args: Any, **kw: Any) -> mx.array:
        logits = self._model(inputs, *args, **kw)
        if inputs.size < 2:
            return logits
        self._key, sub = mx.random.split(self._key)
        z = logits.astype(mx.float32)
        scale = self._ulps * self._eps * mx.max(mx.abs(z), axis=-1, keepdims=True)
        return (z + scale * mx.random.uniform(-1.0, 1.0, z.shape, key=sub)).astype(logits.dtype)


def simulated_target(target: Target, dtype: str, ulps: float = DEFAULT_ULPS, seed: int = 0) -> Target:
    """`target` under the regime (module rules); its name says so."""
    if dtype not in EPS:
        raise TargetError(f"--simulate-rounding {dtype!r}: choose one of {sorted(EPS)}")
    positional = [p for p in target._parameters() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    old_form = bool(positional) and positional[0].name not in KEYWORDS  # factory(model, ...)
    if not target.accepts("model") and not old_form:  # it gets no model: it loads its own
        raise TargetError(
            f"{target.name}: its factory loads its own model, so the simulated rounding regime "
            "cannot reach its forwards"
        )

    def factory(model: Any, head: Any = None, temperature: float = 0.0, checkpoint: str | None = None) -> Any:
        if not target.needs_head:
            return target.build(
                NoisyModel(model, dtype, ulps, seed), head, temperature, checkpoint=checkpoint
            )
        from melix_mlx.batch_generator import MTPBatchGenerator

        built = target.build(model, head, temperature, checkpoint=checkpoint)
        if not isinstance(built, MTPBatchGenerator):
            raise TargetError(
                f"{target.name}: the regime needs an MTPBatchGenerator, got {type(built).__name__}"
            )
        built.__class__ = simulated_rounding(dtype, ulps, seed, base=type(built))  # its verify rounds
        built._noise_key = [mx.random.key(seed)]  # what the class's __init__ would have set
        return built

    if not target.accepts("temperature"):  # keep what the target can do: no sampling without it

        def greedy(model: Any, head: Any = None, checkpoint: str | None = None) -> Any:
            return factory(model, head, 0.0, checkpoint)

        return replace(target, name=f"{target.name} (simulated {dtype} rounding)", factory=greedy)
    return replace(target, name=f"{target.name} (simulated {dtype} rounding)", factory=factory)


__all__ = ["DEFAULT_ULPS", "NoisyModel", "simulated_target"]
