"""What a sampled row's own prompt says about the acceptance its decode will see.

Rules of this module:
- Teacher-forced over the prompt's last `SLOTS` head slots: slot j joins the main model's
  h_j with t_{j+1} and drafts t_{j+2}, whose target distribution is the main model's at
  position j + 1. The head already runs over every slot to prime its cache, so scoring
  costs two vocabulary projections of `SLOTS` rows, no forward.
- Both distributions go through the row's sampling settings (temperature, top-p, min-p,
  top-k: `sampling.probabilities`); a slot scores sum_x min(p(x), q(x)), the exact
  probability that speculative sampling accepts a draft drawn from q
  (melix_mlx.runtime.acceptance). The row's score is the mean over its slots.
- Sampled rows only. On held-out prompts the sampled overlap tracks what the decode then
  measures, while the greedy match rate on prompt text reads well below the acceptance on
  the model's own greedy continuation (benchmarks/bench_prompt_acceptance.py); greedy rows
  keep the family prior. Logits processors are not applied: an estimate, not a verify.
- Lazy: graph nodes, evaluated where the decoder hands the score to the controller.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import SamplingParams, normalize_logits, probabilities

SLOTS = 32  # prompt slots scored per sampled row (the mean's standard error is at most 0.09)


def sampled_overlap(main_logits: mx.array, head_logits: mx.array, params: SamplingParams) -> mx.array:
    """Mean over slots of sum_x min(p(x), q(x)): main_logits [m, V] are the target's at
    the positions the head's slots head_logits [m, V] draft for."""
    p = probabilities(normalize_logits(main_logits), params)
    q = probabilities(normalize_logits(head_logits), params)
    return mx.minimum(p, q).sum(axis=-1).mean()
