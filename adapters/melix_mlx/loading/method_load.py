"""Load a checkpoint for a speculative method: the model plus what fills its head slot.

Rules of this module:
- One loader for every front end (`melix-fsm generate`, `melix-fsm serve`), so a method
  means the same model and head slot wherever it is started.
- The head slot holds the checkpoint's MTP head (`method = mtp`) or a draft model whose
  tokenizer was checked against the target's (`method = draft_model`).
- `load_plain` loads any checkpoint mlx-lm can load: through the project loader (which
  drops head tensors mlx-lm's strict load would trip on), else mlx-lm's own loader for
  families without an MTP head.
- Typed failures (`HeadLoadError`, `UnsupportedServing`) propagate; the caller decides
  between refusing and decoding plainly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_plain(model_dir: Path, sharding: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) without a head; `sharding` under mlx.launch (melix_mlx.runtime.distributed)."""
    if sharding is not None:
        from ..runtime.distributed import load_sharded

        model, tokenizer, _, _ = load_sharded(model_dir, sharding, with_head=False)
        return model, tokenizer
    from mlx_lm.utils import load_model, load_tokenizer

    from .errors import UnsupportedModel
    from .loaders import load_main

    try:
        model, config = load_main(model_dir)
    except UnsupportedModel:  # no MTP family: nothing to strip
        model, config = load_model(model_dir)
    return model, load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id", None))


def load_for_method(model_dir: Path, config: Any, sharding: str | None = None) -> tuple[Any, Any, Any]:
    """(model, tokenizer, head): the MTP head, or a draft model in the head slot."""
    from melix_fsm.config import Method

    if config.method is Method.draft_model:
        from ..decoding.draft_model import load_draft

        model, tokenizer = load_plain(model_dir, sharding)
        head, _ = load_draft(config.draft_model, tokenizer)  # replicated on every rank
        return model, tokenizer, head
    if sharding is not None:
        from ..runtime.distributed import load_sharded

        model, tokenizer, head, _ = load_sharded(model_dir, sharding)
        return model, tokenizer, head
    from .loaders import load_with_heads

    model, tokenizer, head, _ = load_with_heads(model_dir)
    return model, tokenizer, head
