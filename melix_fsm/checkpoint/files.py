"""Bounded reads of the small files a checkpoint holds: config.json, the index, tokenizers.

Every read is capped (the limits below) and every JSON value is checked for depth before
use; a missing, oversized, unreadable or malformed file is a `CheckpointError(path, problem)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CheckpointError

MAX_CONFIG_BYTES = 4 * 2**20  # real config.json files are a few KiB
MAX_INDEX_BYTES = 64 * 2**20  # DeepSeek-V3's index is ~10 MiB
MAX_TOKENIZER_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64


@contextmanager
def opened(path: Path, what: str) -> Iterator[BinaryIO]:
    """`path` open for binary reading; a missing, directory or unreadable file (also while
    reading it) is a CheckpointError naming `what`."""
    try:
        with open(path, "rb") as f:
            yield f
    except FileNotFoundError:
        raise CheckpointError(str(path), f"{what} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(str(path), f"{what} is a directory, not a file") from None
    except OSError as exc:  # symlink loops (ELOOP), permissions, ...
        raise CheckpointError(str(path), f"{what} cannot be read: {exc.strerror or exc}") from None


def read_bytes(path: Path, cap: int, what: str) -> bytes:
    with opened(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise CheckpointError(str(path), f"{what} is {size} bytes, over the {cap}-byte limit")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(str(path), f"{what} is over the {cap}-byte limit")
    return data


def _depth(value: Any, limit: int) -> bool:
    """Whether `value` nests deeper than `limit` (iterative: no recursion on hostile input)."""
    stack = [(value, 0)]
    while stack:
        item, d = stack.pop()
        if d > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return False


def parse_json(data: bytes, path: Path, what: str) -> Any:
    if not data.strip():
        raise CheckpointError(str(path), f"{what} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(str(path), f"{what} is not UTF-8") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise CheckpointError(str(path), f"{what} nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise CheckpointError(str(path), f"{what} is not valid JSON: {exc}") from None
    if _depth(value, MAX_JSON_DEPTH):
        raise CheckpointError(str(path), f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json(path: Path, cap: int, what: str) -> Any:
    return parse_json(read_bytes(path, cap, what), path, what)


def read_config(model_dir: Path) -> dict[str, Any]:
    config = read_json(model_dir / "config.json", MAX_CONFIG_BYTES, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(
            str(model_dir / "config.json"), f"config.json must be a JSON object, got {type(config).__name__}"
        )
    return config
