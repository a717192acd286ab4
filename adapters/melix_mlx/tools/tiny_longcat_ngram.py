"""Tiny checkpoint of LongCat-Flash n-gram (LongCat-Flash-Lite) in its Hugging Face layout.

Rules:
- Same contract as ``melix_mlx.tools.tiny`` (which dispatches here): seeded weights under
  the upstream HF names and conventions, head tensors included, the shared tokenizer.
- longcat_flash_ngram: LongCat-Flash's tensors and ``model.mtp.*`` head
  (melix_mlx.tools.tiny_ernie_longcat), plus the n-gram embedding's tables
  ``model.ngram_embeddings.embedders.{i}`` [ratio * V + 2i + 1, D // (k (n - 1))] and
  ``model.ngram_embeddings.post_projs.{i}`` [D, D // (k (n - 1))], i < k (n - 1); the word
  table stays ``model.embed_tokens`` (mlx-lm's sanitize moves it into the n-gram
  embedding). Config keys ``emb_neighbor_num`` (n = 4, as mlx-lm's default),
  ``emb_split_num`` and ``ngram_vocab_size_ratio`` (smaller than released, so the tiny
  stays tiny). Like the released config, no head count is written (one head layer).
"""

from __future__ import annotations

from typing import Any

from . import tiny_ernie_longcat
from .tiny_layers import Init

CONFIGS: dict[str, dict[str, Any]] = {
    "longcat_flash_ngram": {
        **tiny_ernie_longcat.CONFIGS["longcat_flash"],
        "architectures": ["LongcatFlashNgramForCausalLM"],
        "model_type": "longcat_flash_ngram",
        "emb_neighbor_num": 4,
        "emb_split_num": 2,
        "ngram_vocab_size_ratio": 2,
    },
}

FAMILIES = tuple(CONFIGS)
HEAD_COUNT_KEY = {"longcat_flash_ngram": "num_nextn_predict_layers"}


def _weights(init: Init, c: dict) -> tuple[dict, dict]:
    main, head = tiny_ernie_longcat.BUILDERS["longcat_flash"](init, c)
    d, v = c["hidden_size"], c["vocab_size"]
    count = c["emb_split_num"] * (c["emb_neighbor_num"] - 1)
    dim = d // count
    for i in range(count):
        rows = c["ngram_vocab_size_ratio"] * v + 2 * i + 1
        main[f"model.ngram_embeddings.embedders.{i}.weight"] = init.normal((rows, dim), 1.0)
        main[f"model.ngram_embeddings.post_projs.{i}.weight"] = init.linear(d, dim)
    return main, head


BUILDERS = {"longcat_flash_ngram": _weights}
