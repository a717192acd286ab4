"""Each request's sampler and logits processors, as the server builds them for its batch.

Rules of this module:
- A sampled request without a seed gets the tagged sampler (melix_mlx.runtime.sampling),
  whose distribution speculation can verify: its row speculates with the rejection rule
  (lossless). mlx-lm's own sampler is untagged, and a row with it would never draft.
  A request with XTC (its draw is not a fixed distribution) keeps mlx-lm's sampler: its
  row decodes plainly in the batch and its usage says why (`unknown sampler`).
- A seeded request stays in the batch with its own random stream: its last logits
  processor draws the token of each position from the request's distribution (mlx-lm's
  filters, then temperature) with a key made of the seed and the position (the length of
  the history before it), and leaves only that token; the row's sampler is then greedy.
  The draw at a position depends on the seed, the position and that row's logits alone,
  so the output is the same whatever else is in the batch, whether the row speculates or
  not (a draft is accepted only when it equals the seeded draw: exact, at a lower
  acceptance than the rejection rule), and on every rank of a sharded server.
- The processor leaves one token, so a seeded request cannot report log-probabilities,
  and XTC draws outside it: both are refused with a seed (melix_mlx.serve.protocol).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from ..runtime.sampling import SamplingParams, filtered_logprobs, make_sampler, normalize_logits

MASK = 0xFFFF_FFFF_FFFF_FFFF


def stream_key(seed: int, position: int) -> int:
    """A 64-bit key for (seed, position): splitmix64 of the pair, so nearby pairs differ."""
    z = (seed * 0x9E37_79B9_7F4A_7C15 + position + 1) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & MASK
    return z ^ (z >> 31)


class SeededDraw:
    """The last logits processor of a seeded row (see the module rules)."""

    def __init__(self, seed: int, params: SamplingParams) -> None:
        self.seed = seed
        self.params = params

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        key = mx.random.key(stream_key(self.seed, history.size))
        scaled = filtered_logprobs(normalize_logits(logits), self.params) * (1.0 / self.params.temp)
        token = mx.random.categorical(scaled, key=key)
        keep = mx.arange(logits.shape[-1]) == token[..., None]
        return mx.where(keep, mx.zeros_like(logits), mx.full(logits.shape, -mx.inf, logits.dtype))


def sampling_params(args: Any) -> SamplingParams:
    s = args.sampling
    return SamplingParams(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)


def seeded(args: Any) -> bool:
    """A seeded request that samples (at temperature 0 a seed changes nothing)."""
    return args.seed is not None and args.sampling.temperature > 0


def row_sampler(mlx_make_sampler: Any) -> Any:
    """mlx-lm's `_make_sampler(args, tokenizer)`, as the server's batch needs it."""

    def build(args: Any, tokenizer: Any) -> Any:
        if seeded(args) or args.sampling.temperature == 0:
            return greedy_sampler
        if args.sampling.xtc_probability > 0:
            return mlx_make_sampler(args, tokenizer)  # untagged: the row decodes plainly
        p = sampling_params(args)
        return make_sampler(p.temp, top_p=p.top_p, min_p=p.min_p, top_k=p.top_k)

    return build


def row_processors(mlx_make_processors: Any) -> Any:
    """mlx-lm's `_make_logits_processors(args)`, plus a seeded row's draw (last)."""

    def build(args: Any) -> list[Any]:
        processors = list(mlx_make_processors(args))
        if seeded(args):
            processors.append(SeededDraw(args.seed, sampling_params(args)))
        return processors

    return build
