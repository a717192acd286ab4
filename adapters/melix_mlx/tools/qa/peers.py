"""Factories for public generators: the glue behind docs/qa_gallery.md (our code; no peer code).

Rules of this module:
- Each factory follows the kit's factory contract (melix_mlx.tools.qa.targets) and imports the
  peer's classes only when called, so this module imports anywhere. Run each in the
  peer's own environment (`melix-fsm qa melix_mlx.tools.qa.peers:NAME --model DIR`).
- `mlx_lm_batch`: the installed mlx-lm's `BatchGenerator` (0.31 or 0.32; the kit detects
  its stop keyword), small batches so queueing, joins and filters happen in short
  schedules.
- `airrunner_mtp`: the AirRunner mlx-lm fork's batched MTP (branch feat/mtp-batched,
  installed as `mlx_lm`): its `BatchGenerator(..., mtp=True)` on the model the kit
  loaded with that fork's `load`, which keeps the MTP head (`mtp_forward`); without a
  head there is nothing to test, which is a set-up error.
"""

from __future__ import annotations

from typing import Any


def _sampler(temperature: float) -> Any:
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=temperature)


def mlx_lm_batch(model: Any, temperature: float = 0.0) -> Any:
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, sampler=_sampler(temperature), prefill_batch_size=2, completion_batch_size=3)


def airrunner_mtp(model: Any, temperature: float = 0.0) -> Any:
    from mlx_lm.generate import BatchGenerator

    if not hasattr(model, "mtp_forward"):
        raise ValueError(
            "the loaded model has no mtp_forward: install the fork as mlx_lm, with an MTP checkpoint"
        )
    return BatchGenerator(
        model, sampler=_sampler(temperature), mtp=True, prefill_batch_size=2, completion_batch_size=3
    )
