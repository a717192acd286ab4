"""The corpus and its tokenizer: the running interpreter's own standard library.

The top-level ``*.py`` files of ``sysconfig.get_paths()['stdlib']`` in sorted order, minus
machine-specific ``_sysconfigdata*``; every ``EVAL_EVERY``-th file (index ``% EVAL_EVERY ==
EVAL_OFFSET``) is held out for evaluation and never seen by the tokenizer or the model. The
tokenizer does not depend on any model option, so every model trained by the recipe
shares one ``tokenizer.json`` byte for byte.
"""

from __future__ import annotations

import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

EOS = "<|endoftext|>"
EVAL_EVERY = 10
EVAL_OFFSET = 3


def stdlib_files() -> tuple[Path, list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_sysconfigdata"))
    train = [p for i, p in enumerate(files) if i % EVAL_EVERY != EVAL_OFFSET]
    held = [p for i, p in enumerate(files) if i % EVAL_EVERY == EVAL_OFFSET]
    return root, train, held


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }


def encode_stream(tok: Any, texts: list[str], eos_id: int) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)  # a document boundary the model learns to see
    return np.asarray(ids, dtype=np.int32)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int):
    starts = rng.integers(0, len(stream) - length - 1, size=batch)
    return np.stack([stream[s : s + length + 1] for s in starts])


def eval_windows(stream: np.ndarray, length: int, limit: int) -> np.ndarray:
    n = min(limit, (len(stream) - 1) // length)
    return np.stack([stream[i * length : i * length + length + 1] for i in range(n)])


@dataclass(frozen=True)
class Corpus:
    """The split files, their text, the trained tokenizer and both token streams."""

    root: Path
    train_files: list[Path]
    held_files: list[Path]
    train_texts: list[str]
    held_texts: list[str]
    tok: Any
    eos_id: int
    train_ids: np.ndarray
    held_ids: np.ndarray


def load_corpus(vocab_size: int, timings: dict[str, float], log: Callable[[str], None]) -> Corpus:
    """Read the stdlib split, train the tokenizer on the training files, encode both sides."""
    root, train_files, held_files = stdlib_files()
    train_texts = [read_text(p) for p in train_files]
    held_texts = [read_text(p) for p in held_files]
    log(f"stdlib {root}: {len(train_files)} train files "
        f"({sum(map(len, train_texts))} chars), {len(held_files)} held out")

    t = time.time()
    tok = train_tokenizer(train_texts, vocab_size)
    eos_id = tok.token_to_id(EOS)
    train_ids = encode_stream(tok, train_texts, eos_id)
    held_ids = encode_stream(tok, held_texts, eos_id)
    timings["tokenizer_and_encode_s"] = round(time.time() - t, 2)
    log(f"tokenizer vocab {tok.get_vocab_size()}; {len(train_ids)} train tokens, "
        f"{len(held_ids)} held-out tokens")
    return Corpus(root, train_files, held_files, train_texts, held_texts, tok, eos_id,
                  train_ids, held_ids)
