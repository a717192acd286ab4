"""Checkpoint detection from config.json and safetensors headers only.

Rules of this package (the one hardened reader of untrusted checkpoint files):
- No tensor data is ever read: only config.json, the safetensors index, the 8-byte length
  plus JSON header of each *.safetensors file, and tokenizer files for the vocabulary.
- Every read is bounded (size caps in `files` and `headers`) and every parsed value is
  checked before use (header offsets against the file size, names in the index against
  the directory). Anything unreadable raises `CheckpointError(path, problem)`; no other
  exception escapes `read_checkpoint` or `tokenizer_vocab`.
- What a family's head looks like comes from the registry (spec/families.toml); this
  package only matches the declared prefixes.

Modules: `files` (bounded reads of config.json and other JSON), `headers` (safetensors
headers), `directory` (`Checkpoint`, `read_checkpoint`), `settings` (dotted config keys),
`heads` (head tensors, sidecar markers), `tokenizer` (the vocabulary fingerprint).
"""

from .directory import (
    INDEX_NAME,
    MELIX_CONFIG_KEY,
    MELIX_DEFAULT_FILE,
    MELIX_KEY_PREFIX,
    Checkpoint,
    read_checkpoint,
)
from .files import (
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    MAX_JSON_DEPTH,
    MAX_TOKENIZER_BYTES,
    read_config,
    read_json,
)
from .headers import MAX_HEADER_BYTES, safetensors_header, safetensors_keys
from .heads import HeadScan, head_only, scan_heads, sidecar_marker
from .settings import config_value, int_setting
from .tokenizer import Vocab, tokenizer_vocab

__all__ = [
    "INDEX_NAME",
    "MAX_CONFIG_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_TOKENIZER_BYTES",
    "MELIX_CONFIG_KEY",
    "MELIX_DEFAULT_FILE",
    "MELIX_KEY_PREFIX",
    "Checkpoint",
    "HeadScan",
    "Vocab",
    "config_value",
    "head_only",
    "int_setting",
    "read_checkpoint",
    "read_config",
    "read_json",
    "safetensors_header",
    "safetensors_keys",
    "scan_heads",
    "sidecar_marker",
    "tokenizer_vocab",
]
