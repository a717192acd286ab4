"""The draft-model method: a separate small model drafts, through the same cycle engine as MTP.

Rules of this module:
- `DraftHead` puts an mlx-lm model in the head slot of melix_mlx.runtime.engine. The engine's
  slot convention (pair j feeds token t_{j+1} and predicts t_{j+2}) is exactly a causal
  language model fed one token per position: the draft ignores the main model's hidden
  states and drafts autoregressively from its own KV cache, which the engine primes,
  chains, catches up and rolls back like an MTP head's. So the draft-model method gets
  the same lifecycle, receipts, statistics, device policy and batching as MTP, and the
  same identity: the target model decides every emitted token.
- The draft model never sees the prompt's first token (the slot convention starts at
  t_1); that costs acceptance, never correctness.
- Only trimmable KV caches can be rolled back in the head slot: a draft model with
  recurrent or sliding-window layers is refused (`unsupported_cache_sharing`), typed.
- Tokenizers are compared themselves (`check_tokenizers`: the full token -> id map and
  the EOS ids), not just the configs' vocabulary sizes; a mismatch is `vocab_mismatch`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

from melix_fsm.reasons import RefusalReason

from ..loading.errors import UnsupportedServing
from ..runtime import rollback


class DraftHead(nn.Module):
    """A draft model in the cycle engine's head slot; see the module rules."""

    def __init__(self, draft_model: nn.Module) -> None:
        super().__init__()
        self.draft = draft_model
        bad = sorted({rollback.kind_of(c) for c in rollback.leaves(self.make_cache())} - {"kv"})
        if bad:
            raise UnsupportedServing(
                RefusalReason.unsupported_cache_sharing,
                f"draft model cache kinds {', '.join(bad)} cannot be rolled back in the head slot "
                "(only trimmable KV caches can)",
            )

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.draft)

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Draft logits [B, L, V] for `tokens` [B, L]; the hidden output is a placeholder."""
        logits = self.draft(tokens, cache=cache)
        B, L = tokens.shape
        return logits, mx.zeros((B, L, 1), logits.dtype)


def _vocab(tokenizer: Any) -> dict[str, int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return dict(inner.get_vocab())


def check_tokenizers(target: Any, draft: Any) -> None:
    """Raise `UnsupportedServing(vocab_mismatch)` unless both tokenizers map tokens to ids alike."""
    t_vocab, d_vocab = _vocab(target), _vocab(draft)
    if t_vocab != d_vocab:
        differ = sorted(k for k in t_vocab.keys() ^ d_vocab.keys())[:5] or sorted(
            k for k in t_vocab if t_vocab[k] != d_vocab[k]
        )[:5]
        raise UnsupportedServing(
            RefusalReason.vocab_mismatch,
            f"tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens; e.g. {differ})",
        )
    t_eos = set(getattr(target, "eos_token_ids", ()) or ())
    d_eos = set(getattr(draft, "eos_token_ids", ()) or ())
    if t_eos and d_eos and t_eos != d_eos:
        raise UnsupportedServing(
            RefusalReason.vocab_mismatch, f"EOS ids differ: target {sorted(t_eos)}, draft {sorted(d_eos)}"
        )


def load_draft(path: str | Path, target_tokenizer: Any = None) -> tuple[DraftHead, Any]:
    """Load a draft model directory as `(DraftHead, tokenizer)`; check it against the target's."""
    path = Path(path)
    model, config = load_model(path)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
    if target_tokenizer is not None:
        check_tokenizers(target_tokenizer, tokenizer)
    return DraftHead(model), tokenizer
