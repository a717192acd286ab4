"""LongCat-Flash n-gram (LongCat-Flash-Lite) MTP head: LongCat-Flash's head, unchanged.

Rules:
- The main model is LongCat-Flash's layers behind an n-gram embedding; the MTP head is
  the one ``longcat_flash`` defines (melix_mlx.loading.heads.longcat_flash): the same raw
  keys under ``model.mtp.`` (``layers.0.{enorm.m, hnorm.m, eh_proj}``, one dense latent
  attention layer with ``input_layernorm`` / ``post_attention_layernorm`` and
  ``transformer_layer.mlp``, ``model.mtp.norm``), which mlx-lm's
  ``longcat_flash_ngram.sanitize`` drops with the rest of ``model.mtp``. vLLM serves this
  model_type with the same MTP module (its speculative config maps ``longcat_flash_ngram``
  to ``longcat_flash_mtp``), and the HF modeling code of the n-gram model ignores
  ``model.mtp.*`` on load.
- The head embeds its next token with the plain word embedding, never the n-gram one:
  vLLM's LongCat MTP layer embeds ``input_ids`` through its ``embed_tokens`` table alone
  and carries no n-gram context. The table is the main model's word embedding
  (``model.embed_tokens.weight``, which mlx-lm keeps as
  ``model.ngram_embeddings.word_embeddings``), held by reference like the sibling's;
  ``model.mtp.embed_tokens.weight`` is not loaded. So drafting needs no n-gram context of
  its own, and the main model's context is rolled back by
  melix_mlx.runtime.capture_ngram.
- Concatenation embedding first, plain RMSNorm weights (no +1), post-norm hidden in,
  ``final_layernorm``'s output chained at depth k > 1, one head layer by default: as
  ``longcat_flash``.
"""

from __future__ import annotations

from typing import ClassVar

from . import longcat_flash
from .longcat_flash import from_hf, is_head_key

__all__ = ["MTPHead", "from_hf", "is_head_key"]


class MTPHead(longcat_flash.MTPHead):
    FAMILY: ClassVar[str] = "longcat_flash_ngram"
