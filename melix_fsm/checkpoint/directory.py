"""A checkpoint directory read from config.json and its weight files' headers (`read_checkpoint`).

Weight files are every top-level *.safetensors plus every shard the index names. That
includes `mtp.safetensors` (official Qwen3.5 releases keep the head there, outside
mlx-lm's model*.safetensors glob) and the file a `melix_mtp` config entry names. Names
taken from the checkpoint itself stay inside the directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from ..errors import CheckpointError
from .files import MAX_INDEX_BYTES, read_config, read_json
from .headers import safetensors_keys

INDEX_NAME = "model.safetensors.index.json"
MELIX_CONFIG_KEY = "melix_mtp"  # written by melix_mlx.loading.convert
MELIX_KEY_PREFIX = "melix_mtp."  # head keys of a converted checkpoint
MELIX_DEFAULT_FILE = "mtp.safetensors"


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
        """`layer_types` lists a "sliding_attention" layer (a family whose mlx-lm model reads
        layer_types gives it a RotatingKVCache; `use_sliding_window` alone turns on no
        window in the mlx-lm model of any registered family, so it is not read here)."""
        layer_types = self.text.get("layer_types")
        return isinstance(layer_types, list) and "sliding_attention" in layer_types

    @property
    def melix_file(self) -> str | None:
        melix = self.config.get(MELIX_CONFIG_KEY)
        if not isinstance(melix, dict):
            return None
        name = melix.get("file", MELIX_DEFAULT_FILE)
        return name if isinstance(name, str) else None


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
