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
- `mlx_vlm_mtp`: the installed mlx-vlm's batched MTP (`BatchGenerator` with the drafter
  `load_drafter(CHECKPOINT, kind="mtp")` builds from the checkpoint's head, k = 2: block
  size 3) on the model mlx-vlm itself loads from `checkpoint`, behind the kit's batch
  surface (melix_mlx.tools.peers_vlm.QABatch states what that glue does and no more).
  `mlx_vlm_plain` is the same generator without the drafter, the control.
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


_VLM_PEERS: dict[str, Any] = {}  # one mlx-vlm load per checkpoint: the kit builds many generators


def _vlm_generator(checkpoint: str, temperature: float, k: int | None) -> Any:
    from melix_mlx.tools.peers_vlm import QABatch, load_peer

    if checkpoint not in _VLM_PEERS:
        _VLM_PEERS[checkpoint] = load_peer(checkpoint)
    sampler = None
    if temperature > 0:
        from mlx_vlm.sample_utils import make_sampler

        sampler = make_sampler(temp=temperature)
    return QABatch(_VLM_PEERS[checkpoint], k, sampler, prefill_batch_size=2, completion_batch_size=3)


def mlx_vlm_mtp(checkpoint: str, temperature: float = 0.0) -> Any:
    return _vlm_generator(checkpoint, temperature, k=2)


def mlx_vlm_plain(checkpoint: str, temperature: float = 0.0) -> Any:
    return _vlm_generator(checkpoint, temperature, k=None)
