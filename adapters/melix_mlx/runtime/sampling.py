"""Target and draft distributions, and the acceptance rules of speculative decoding.

Rules of this module:
- Lossless sampling needs the distribution the sampler draws from, not just a sampler
  callable. `make_sampler` here wraps mlx-lm's own `make_sampler` and records its
  parameters on the callable; `params_of` recovers them. A sampler whose parameters
  cannot be known (a custom callable, XTC) returns None: the caller must then refuse
  speculation for that sequence and record why; nothing guesses.
- `probabilities` reproduces exactly what mlx-lm's sampler draws from: the filters in
  mlx-lm's order (top-p, min-p, top-k) applied to the log-probabilities, then
  `softmax(logprobs / temp)` (mlx-lm samples `categorical(logprobs * (1 / temp))`).
- Greedy acceptance is exact match with the target's argmax. Sampled acceptance is the
  standard rule: accept draft d with probability min(1, p(d) / q(d)); on the first
  rejection draw from normalise(max(p - q, 0)); after k acceptances draw the bonus
  token from p. The output then has the target distribution whatever q is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
)
from mlx_lm.sample_utils import make_sampler as _mlx_make_sampler

Sampler = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """The parameters of mlx-lm's `make_sampler` that shape the distribution."""

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0


GREEDY = SamplingParams()

# Why a row whose sampler's distribution is unknown never speculates (both decoders say it).
UNKNOWN_SAMPLER = "unknown sampler: its distribution cannot be verified losslessly"


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
) -> Sampler:
    """mlx-lm's sampler for these parameters, tagged so speculation can read them back."""
    params = SamplingParams(temp, top_p, min_p, min_tokens_to_keep, top_k)
    if params.greedy:
        return greedy_sampler
    inner = _mlx_make_sampler(
        temp=temp, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep, top_k=top_k
    )

    def sampler(logprobs: mx.array) -> mx.array:
        return inner(logprobs)

    sampler.melix_params = params  # type: ignore[attr-defined]
    return sampler


def params_of(sampler: Sampler | None) -> SamplingParams | None:
    """The distribution parameters of `sampler`, or None when they cannot be known."""
    if sampler is None or sampler is greedy_sampler:
        return GREEDY
    return getattr(sampler, "melix_params", None)


def filtered_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Apply the sampler's filters in mlx-lm's order; masked tokens get -inf."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def probabilities(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The distribution mlx-lm's sampler draws from, over the last axis (float32)."""
    scaled = filtered_logprobs(logprobs.astype(mx.float32), params) * (1.0 / params.temp)
    return mx.softmax(scaled, axis=-1)


def normalize_logits(logits: mx.array) -> mx.array:
    """Log-probabilities from logits, as mlx-lm computes them before sampling."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample_from(probs: mx.array, key: mx.array | None = None) -> mx.array:
    """Draw one token per row of `probs` [.., V]."""
    return mx.random.categorical(mx.log(probs), key=key)
