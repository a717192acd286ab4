"""Read a checkpoint folder, write its widened copy (rules in `widen`; numpy, no mlx).

Rules:
- The output mirrors the source's files: every tensor goes to the file of the same name
  it came from (``model.safetensors``, a ``mtp.safetensors`` sidecar, numbered shards),
  ``model.safetensors.index.json`` is rewritten with the new total size when the source
  has one, ``config.json`` gets the widened sizes, every other file (tokenizer, generation
  config, training report) is copied byte for byte, and ``widening.json`` records how.
- Shards are streamed one tensor at a time (header first, from the planned shapes), so
  widening a large checkpoint needs one tensor's memory, not the model's.
- Written into ``DST.partial`` and renamed at the end: an interrupted run leaves no
  half-written checkpoint under DST.
- Progress: a tqdm bar over bytes when stderr is a terminal; nothing otherwise.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .widen import Plan, Sizes, WidenError

DTYPES = {"F32": np.float32, "F16": np.float16}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
RECEIPT = "widening.json"


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype code, shape)} of one safetensors file, from its header."""
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in _header(path).items() if k != "__metadata__"}


def _read(path: Path, header: dict[str, Any], name: str) -> np.ndarray:
    info = header[name]
    begin, end = info["data_offsets"]
    with path.open("rb") as f:
        f.seek(8 + struct.unpack("<Q", f.read(8))[0] + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype=DTYPES[info["dtype"]]).reshape(info["shape"])


def _write_shard(
    path: Path,
    plan: list[tuple[str, str, tuple[int, ...]]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str],
    advance: Callable[[int], None],
) -> int:
    """Write `plan` ([(name, dtype code, shape)]) as one safetensors file; its data bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, code, shape in plan:
        size = int(np.prod(shape)) * np.dtype(DTYPES[code]).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, code, shape in plan:
            array = np.ascontiguousarray(produce(name), dtype=DTYPES[code])
            if array.shape != shape:
                raise WidenError(f"tensor {name!r}: produced {array.shape}, planned {shape}")
            f.write(array.tobytes())
            advance(array.nbytes)
    return offset


def _progress(total: int, label: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    if not sys.stderr.isatty():
        return (lambda n: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with mlx-lm's dependencies; its absence is not an error
        return (lambda n: None), (lambda: None)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=label, leave=False)
    return bar.update, bar.close


def _source_files(src: Path) -> Iterator[Path]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise WidenError(f"{src}: no *.safetensors files")
    yield from files


def widen_checkpoint(
    src: Path, dst: Path, sizes: Sizes, *, seed: int = 0, force: bool = False
) -> dict[str, Any]:
    """Write the widened copy of checkpoint folder `src` to `dst`; returns the receipt."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise WidenError(f"{src}: not a checkpoint folder (no config.json)")
    config = json.loads((src / "config.json").read_text())
    plan = Plan(config, sizes)
    files = {path.name: (path, _header(path)) for path in _source_files(src)}
    shapes: dict[str, tuple[int, ...]] = {}
    for path, _ in files.values():
        for name, (code, shape) in _tensors(path).items():
            if code not in DTYPES:
                raise WidenError(f"tensor {name!r}: dtype {code} (widening reads F32 / F16)")
            shapes[name] = shape
    plan.check(shapes)
    if dst.exists() and not force:
        raise WidenError(f"{dst} exists (pass --force to replace it)")
    if dst.resolve() == src.resolve():
        raise WidenError("DST must differ from SRC")
    layout = {
        fname: [(n, code, plan.shape(n, shape)) for n, (code, shape) in _tensors(path).items()]
        for fname, (path, _) in files.items()
    }
    total = sum(int(np.prod(s)) * np.dtype(DTYPES[c]).itemsize for p in layout.values() for _, c, s in p)
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    advance, close = _progress(total, f"widen {src.name}")
    try:
        for fname, tensors in layout.items():
            path, header = files[fname]
            meta = header.get("__metadata__") or {"format": "pt"}

            def produce(name: str, path: Path = path, header: dict = header) -> np.ndarray:
                return plan.widen_tensor(name, _read(path, header, name), seed)

            _write_shard(tmp / fname, tensors, produce, meta, advance)
    finally:
        close()
    receipt = _finish(src, tmp, plan, layout, total, sizes, seed)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return receipt


def _finish(
    src: Path, tmp: Path, plan: Plan, layout: dict[str, list], total: int, sizes: Sizes, seed: int
) -> dict[str, Any]:
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", RECEIPT):
            shutil.copyfile(path, tmp / path.name)
    (tmp / "config.json").write_text(json.dumps(plan.widened_config(), indent=2) + "\n")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        old = json.loads(index.read_text())
        weight_map = {name: fname for fname, tensors in layout.items() for name, _, _ in tensors}
        new = {**old, "metadata": {**old.get("metadata", {}), "total_size": total}, "weight_map": weight_map}
        (tmp / index.name).write_text(json.dumps(new, indent=2) + "\n")
    t = plan.new
    receipt = {
        "source": str(src),
        "seed": seed,
        "bytes": total,
        "requested": {k: v for k, v in vars(sizes).items() if v is not None},
        "sizes": {k: t[k] for k in sorted(t) if isinstance(t[k], int) and k in _SIZE_KEYS},
        "residual_scale": plan.s,
        "note": "function-preserving: new hidden dims, heads and MLP units read by zero output "
        "projections; their input-side weights are seeded random (see melix_mlx/tools/widen.py)",
    }
    (tmp / RECEIPT).write_text(json.dumps(receipt, indent=2) + "\n")
    return receipt


_SIZE_KEYS = {
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "head_dim",
    "kv_lora_rank",
    "num_hidden_layers",
}
