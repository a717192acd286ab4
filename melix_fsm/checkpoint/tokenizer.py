"""A tokenizer's vocabulary fingerprint (tokenizer.json or tokenizer.model), read bounded."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from ..errors import CheckpointError
from .files import MAX_TOKENIZER_BYTES, read_bytes, read_json


class Vocab(msgspec.Struct, frozen=True):
    """A tokenizer's vocabulary fingerprint."""

    source: str  # "tokenizer.json" or "tokenizer.model"
    size: int  # number of token ids (0 when only a sentencepiece file is present)
    digest: str  # sha256 of the (token, id) pairs, or of the sentencepiece file


def tokenizer_vocab(model_dir: str | os.PathLike[str]) -> Vocab | None:
    """The vocabulary fingerprint from tokenizer.json (or tokenizer.model); None if neither exists."""
    root = Path(model_dir)
    path = root / "tokenizer.json"
    if path.exists() or path.is_symlink():
        data = read_json(path, MAX_TOKENIZER_BYTES, "tokenizer.json")
        pairs = _vocab_pairs(data)
        if pairs is None:
            raise CheckpointError(str(path), "tokenizer.json has no readable model.vocab")
        encoded = json.dumps(sorted(pairs, key=lambda p: (p[1], p[0])), ensure_ascii=False).encode("utf-8")
        size = max((i for _, i in pairs), default=-1) + 1
        return Vocab("tokenizer.json", size, hashlib.sha256(encoded).hexdigest())
    path = root / "tokenizer.model"
    if path.exists() or path.is_symlink():
        data = read_bytes(path, MAX_TOKENIZER_BYTES, "tokenizer.model")
        return Vocab("tokenizer.model", 0, hashlib.sha256(data).hexdigest())
    return None


def _vocab_pairs(data: Any) -> list[tuple[str, int]] | None:
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pairs: dict[tuple[str, int], None] = {}
    if isinstance(vocab, dict):  # BPE / WordPiece / WordLevel: token -> id
        for token, i in vocab.items():
            if type(i) is not int:
                return None
            pairs[(token, i)] = None
    elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
        for i, item in enumerate(vocab):
            if not isinstance(item, list) or not item or not isinstance(item[0], str):
                return None
            pairs[(item[0], i)] = None
    else:
        return None
    added = data.get("added_tokens") or []
    if not isinstance(added, list):
        return None
    for tok in added:
        if (
            not isinstance(tok, dict)
            or not isinstance(tok.get("content"), str)
            or type(tok.get("id")) is not int
        ):
            return None
        pairs[(tok["content"], tok["id"])] = None
    return list(pairs)
