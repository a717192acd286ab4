"""Checkpoint detection from config.json and safetensors headers only.
(Over 400 lines: it is the package's one hardened reader of untrusted checkpoint files;
every bound and check on them stays in one place. Splitting it is open work.)

Rules of this module:
- No tensor data is ever read: only config.json, the safetensors index, the 8-byte length
  plus JSON header of each *.safetensors file, and tokenizer files for the vocabulary.
- Every read is bounded (size caps below) and every parsed value is checked before use
  (header offsets against the file size, names in the index against the directory).
  Anything unreadable raises `CheckpointError(path, problem)`; no other exception escapes
  `read_checkpoint` or `tokenizer_vocab`.
- Weight files are every top-level *.safetensors plus every shard the index names. That
  includes `mtp.safetensors` (official Qwen3.5 releases keep the head there, outside
  mlx-lm's model*.safetensors glob) and the file a `melix_mtp` config entry names.
- What a family's head looks like comes from the registry (spec/families.toml); this
  module only matches the declared prefixes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import msgspec

from .errors import CheckpointError
from .registry import Family, SidecarMarkers

MAX_CONFIG_BYTES = 4 * 2**20  # real config.json files are a few KiB
MAX_INDEX_BYTES = 64 * 2**20  # DeepSeek-V3's index is ~10 MiB
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own header limit
MAX_TOKENIZER_BYTES = 64 * 2**20
MAX_JSON_DEPTH = 64

INDEX_NAME = "model.safetensors.index.json"
MELIX_CONFIG_KEY = "melix_mtp"  # written by melix_mlx.convert
MELIX_KEY_PREFIX = "melix_mtp."  # head keys of a converted checkpoint
MELIX_DEFAULT_FILE = "mtp.safetensors"

# Bytes per element of the safetensors dtypes; unknown dtypes skip the size check.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


class Checkpoint(msgspec.Struct, frozen=True):
    """What detection learnt about one checkpoint directory (no tensor data)."""

    path: str
    config: dict[str, Any]
    keys: dict[str, str]  # tensor name -> file name (relative to the directory)
    files: tuple[str, ...]  # the weight files read, sorted

    @property
    def text(self) -> dict[str, Any]:
        """The language-model settings (nested under text_config for VL wrappers)."""
        inner = self.config.get("text_config")
        return inner if isinstance(inner, dict) else self.config

    @property
    def model_type(self) -> str | None:
        for cfg in (self.config, self.text):
            value = cfg.get("model_type")
            if isinstance(value, str) and value:
                return value
        return None

    @property
    def model_types(self) -> tuple[str, ...]:
        """model_type, then text_config.model_type: registry lookups try both."""
        out: list[str] = []
        for cfg in (self.config, self.text):
            value = cfg.get("model_type")
            if isinstance(value, str) and value and value not in out:
                out.append(value)
        return tuple(out)

    @property
    def quantized(self) -> bool:
        return any(
            isinstance(cfg.get(k), dict)
            for cfg in (self.config, self.text)
            for k in ("quantization", "quantization_config")
        )

    @property
    def sliding_window(self) -> bool:
        """Some layer attends over a sliding window (mlx-lm gives it a RotatingKVCache)."""
        text = self.text
        layer_types = text.get("layer_types")
        if isinstance(layer_types, list) and "sliding_attention" in layer_types:
            return True
        return text.get("use_sliding_window") is True and isinstance(text.get("sliding_window"), int)

    @property
    def melix_file(self) -> str | None:
        melix = self.config.get(MELIX_CONFIG_KEY)
        if not isinstance(melix, dict):
            return None
        name = melix.get("file", MELIX_DEFAULT_FILE)
        return name if isinstance(name, str) else None


class HeadScan(msgspec.Struct, frozen=True):
    """Head weights found for one family layout."""

    head_format: str  # "hf" (upstream names) or "melix" (converted)
    layer_counts: list[int]  # tensors per advertised head layer
    weight_count: int  # head tensors in total (layers + shared)
    missing: list[str]  # required prefixes with no tensor
    files: list[str]  # files holding head tensors

    @property
    def present(self) -> bool:
        return not self.missing and self.weight_count > 0


class Vocab(msgspec.Struct, frozen=True):
    """A tokenizer's vocabulary fingerprint."""

    source: str  # "tokenizer.json" or "tokenizer.model"
    size: int  # number of token ids (0 when only a sentencepiece file is present)
    digest: str  # sha256 of the (token, id) pairs, or of the sentencepiece file


# -- bounded reads ----------------------------------------------------------------------


def _read_bytes(path: Path, cap: int, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > cap:
                raise CheckpointError(str(path), f"{what} is {size} bytes, over the {cap}-byte limit")
            data = f.read(cap + 1)
    except FileNotFoundError:
        raise CheckpointError(str(path), f"{what} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(str(path), f"{what} is a directory, not a file") from None
    except OSError as exc:  # symlink loops (ELOOP), permissions, ...
        raise CheckpointError(str(path), f"{what} cannot be read: {exc.strerror or exc}") from None
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


def _parse_json(data: bytes, path: Path, what: str) -> Any:
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
    return _parse_json(_read_bytes(path, cap, what), path, what)


def read_config(model_dir: Path) -> dict[str, Any]:
    config = read_json(model_dir / "config.json", MAX_CONFIG_BYTES, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(
            str(model_dir / "config.json"), f"config.json must be a JSON object, got {type(config).__name__}"
        )
    return config


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
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(str(path), f"{name} is truncated: no 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    str(path), f"{name} declares a {n}-byte header, over the format's limit"
                )
            if n > file_size - 8:
                raise CheckpointError(
                    str(path), f"{name} is truncated: header of {n} bytes, file of {file_size}"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(str(path), f"{name} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(str(path), f"{name} is a directory, not a file") from None
    except OSError as exc:
        raise CheckpointError(str(path), f"{name} cannot be read: {exc.strerror or exc}") from None
    header = _parse_json(raw, path, f"{name} header")
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


def _plain_name(model_dir: Path, name: Any, where: Path, what: str) -> Path:
    """A file named by the checkpoint itself, kept inside the directory."""
    if not isinstance(name, str) or not name or name.startswith(("/", "\\")) or ".." in Path(name).parts:
        raise CheckpointError(str(where), f"{what} {name!r} is not a file name inside the checkpoint")
    return model_dir / name


def _index_shards(model_dir: Path) -> list[Path]:
    index_path = model_dir / INDEX_NAME
    if not index_path.exists() and not index_path.is_symlink():
        return []
    index = read_json(index_path, MAX_INDEX_BYTES, INDEX_NAME)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(str(index_path), f"{INDEX_NAME} has no weight_map object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(str(index_path), f"{INDEX_NAME} weight_map must map tensor names to file names")
    shards = []
    for shard in sorted(set(weight_map.values())):
        path = _plain_name(model_dir, shard, index_path, "weight_map names shard")
        if not path.is_file():
            raise CheckpointError(
                str(index_path), f"{INDEX_NAME} names shard {shard!r}, which does not exist"
            )
        shards.append(path)
    return shards


def read_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Read config.json and every weight file's header; raise CheckpointError on bad input."""
    root = Path(model_dir)
    if not root.is_dir():  # also False for a symlink loop
        raise CheckpointError(str(root), "is not a readable directory")
    config = read_config(root)
    try:
        files = {p.name: p for p in root.glob("*.safetensors")}
    except OSError as exc:
        raise CheckpointError(str(root), f"cannot be listed: {exc.strerror or exc}") from None
    for shard in _index_shards(root):
        files.setdefault(shard.relative_to(root).as_posix(), shard)
    melix = config.get(MELIX_CONFIG_KEY)
    if isinstance(melix, dict):
        name = melix.get("file", MELIX_DEFAULT_FILE)
        path = _plain_name(root, name, root / "config.json", f"{MELIX_CONFIG_KEY}.file")
        if not path.is_file():
            raise CheckpointError(
                str(root / "config.json"), f"{MELIX_CONFIG_KEY} names {name!r}, which does not exist"
            )
        files.setdefault(str(name), path)
    if not files:
        raise CheckpointError(str(root), "has no *.safetensors weight files")
    keys: dict[str, str] = {}
    for name in sorted(files):
        for key in safetensors_keys(files[name]):
            keys.setdefault(key, name)
    return Checkpoint(str(root), config, keys, tuple(sorted(files)))


# -- config values ----------------------------------------------------------------------


def config_value(config: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key such as "text_config.mtp_num_hidden_layers"."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def int_setting(
    config: dict[str, Any], keys: tuple[str, ...], lo: int, hi: int
) -> tuple[str | None, int | None, str]:
    """(key found, value, problem) for the first present key; value is None when absent or bad."""
    for key in keys:
        found, value = config_value(config, key)
        if not found or value is None:
            continue
        if type(value) is not int:
            return key, None, f"{key} = {value!r} is not an integer"
        if not lo <= value <= hi:
            return key, None, f"{key} = {value} is outside [{lo}, {hi}]"
        return key, value, ""
    return None, None, ""


# -- head weights -----------------------------------------------------------------------


def _matches(key: str, prefix: str) -> bool:
    # A prefix matches at the start or after a "." so VL wrappers need no entry.
    return key.startswith(prefix) or f".{prefix}" in key


def scan_heads(ckpt: Checkpoint, family: Family, head_count: int, layer_count: int) -> HeadScan:
    """Which of the family's head tensors the checkpoint holds, per advertised layer."""
    if ckpt.melix_file is not None:
        melix_keys = [k for k, f in ckpt.keys.items() if k.startswith(MELIX_KEY_PREFIX)]
        if melix_keys:  # converted: every melix_mtp.* key is a head tensor, named as loaded
            files = sorted({ckpt.keys[k] for k in melix_keys})
            return HeadScan("melix", [len(melix_keys)], len(melix_keys), [], files)
    layout = family.weights
    assert layout is not None
    counts: list[int] = []
    missing: list[str] = []
    head_files: set[str] = set()
    claimed: set[str] = set()
    for j in range(head_count):
        prefix = layout.layer_prefix(j, layer_count)
        layer_keys = [k for k in ckpt.keys if _matches(k, prefix)]
        counts.append(len(layer_keys))
        claimed.update(layer_keys)
        if not layer_keys:
            missing.append(prefix)
            continue
        for sub in layout.layer_required:
            if not any(_matches(k, prefix + sub) for k in layer_keys):
                missing.append(prefix + sub)
    for prefix in layout.shared:
        shared_keys = [k for k in ckpt.keys if _matches(k, prefix)]
        claimed.update(shared_keys)
        if not shared_keys:
            missing.append(prefix)
    head_files.update(ckpt.keys[k] for k in claimed)
    return HeadScan("hf", counts, len(claimed), missing, sorted(head_files))


def head_only(ckpt: Checkpoint, scan: HeadScan) -> bool:
    """Every tensor in the checkpoint is a head tensor: an MTP-only (sidecar) checkpoint."""
    return bool(ckpt.keys) and scan.weight_count == len(ckpt.keys)


def sidecar_marker(config: dict[str, Any], markers: SidecarMarkers) -> str | None:
    """The first marker saying `config` describes an assistant / MTP-only checkpoint."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for cfg in (config, text):
        model_type = cfg.get("model_type")
        if isinstance(model_type, str):
            for suffix in markers.model_type_suffixes:
                if model_type.endswith(suffix):
                    return f"model_type {model_type!r} names an assistant/MTP-only checkpoint"
        archs = cfg.get("architectures")
        if isinstance(archs, list):
            for arch in archs:
                if isinstance(arch, str) and any(m in arch for m in markers.architecture_markers):
                    return f"architecture {arch!r} is an assistant/MTP-only checkpoint"
        for key in markers.config_keys:
            if key in cfg:
                return f"config key {key!r} marks an assistant/draft sidecar"
        layers = cfg.get("num_hidden_layers")
        if type(layers) is int and layers == 0:
            return "num_hidden_layers = 0: the checkpoint has no main model"
    return None


# -- tokenizer --------------------------------------------------------------------------


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
        data = _read_bytes(path, MAX_TOKENIZER_BYTES, "tokenizer.model")
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
