"""The package's one reader of safetensors headers: the 8-byte length and the JSON header.

No tensor data is read. Sizes are bounded, and the JSON and every tensor entry are
checked against the file's length; any problem is a CheckpointError naming the file.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .files import opened, parse_json

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own header limit

# Bytes per element of the safetensors dtypes; unknown dtypes skip the size check.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def safetensors_keys(path: Path) -> list[str]:
    """Tensor names in a safetensors file, from its header; the header is fully checked."""
    return list(safetensors_header(path))


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` of a safetensors file, read from its header alone.

    The one reader of safetensors headers in the package: sizes are bounded, the JSON and
    every entry are checked against the file's length, and any problem is a
    CheckpointError naming the file; no tensor data is read.
    """
    name = path.name
    with opened(path, name) as f:
        file_size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(str(path), f"{name} is truncated: no 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(str(path), f"{name} declares a {n}-byte header, over the format's limit")
        if n > file_size - 8:
            raise CheckpointError(str(path), f"{name} is truncated: header of {n} bytes, file of {file_size}")
        raw = f.read(n)
    header = parse_json(raw, path, f"{name} header")
    if not isinstance(header, dict):
        raise CheckpointError(str(path), f"{name} header must be a JSON object")
    data_len = file_size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        problem = _tensor_problem(info, data_len)
        if problem:
            raise CheckpointError(str(path), f"{name}: tensor {key!r}: {problem}")
        out[key] = (info["dtype"], tuple(info["shape"]))
    return out


def _tensor_problem(info: Any, data_len: int) -> str | None:
    if not isinstance(info, dict):
        return "entry is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        return "dtype is not a string"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return "shape is not a list of non-negative integers"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return "data_offsets is not [begin, end] with 0 <= begin <= end"
    if offsets[1] > data_len:
        return f"data ends at {offsets[1]} but the file holds {data_len} data bytes (truncated)"
    width = _DTYPE_BYTES.get(dtype)
    if width is not None:
        count = 1
        for d in shape:
            count *= d
        if count * width != offsets[1] - offsets[0]:
            return f"{dtype}{shape} needs {count * width} bytes, offsets give {offsets[1] - offsets[0]}"
    return None
