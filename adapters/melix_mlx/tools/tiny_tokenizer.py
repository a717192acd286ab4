"""A small offline byte-level tokenizer shared by every tiny checkpoint.

Rules:
- Built with the ``tokenizers`` library, no download: ids 0..255 are the 256 byte-level
  symbols, then the special tokens in ``SPECIAL_TOKENS`` (so any text round-trips).
- ``vocab_size`` of the tiny models equals ``len(vocab)`` so every id decodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
EOS_TOKEN_ID = 256

# ChatML-like template, enough for mlx-lm's chat helpers.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_token_ids() -> list[int]:
    return list(range(256, VOCAB_SIZE))


def write_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    # Order the 256 byte symbols by the byte they stand for, so id == byte value.
    byte_to_symbol = _bytes_to_unicode()
    vocab = {byte_to_symbol[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out_dir / "tokenizer.json"))

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    special = {"eos_token": SPECIAL_TOKENS[0], "pad_token": SPECIAL_TOKENS[0]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-symbol table (the ByteLevel alphabet)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
