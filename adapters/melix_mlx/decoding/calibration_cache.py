"""The device policy's calibration, kept per model and machine across calls and processes.

Rules of this module:
- A calibration (melix_mlx.runtime.calibrate) times this machine's forwards; it depends on
  the model, its dtype, the mlx / mlx-lm / melix-fsm versions, the machine and the BLAS
  library doing the matmuls, and on what was timed (batch size, depth, context, and the
  forwards' inputs: `calibrate.FORWARDS`). The key
  is all of these; any change is a miss and the figures are measured again. The model
  is named by its resolved path and each weight and config file's name, size and mtime.
- Only a measured `TimingTable` is stored on disk. A failed calibration is not: the next
  process measures again (and the controller disables on the failure, as without a
  cache). Within one process a failure is kept for FAILURE_RETRY_S and then measured
  again: a library that decodes prompt after prompt on a machine too busy to measure
  would otherwise spend the whole budget on every call.
- One JSON file per key under `cache_root()`: $MELIX_FSM_CALIBRATION_CACHE, else the
  melix-fsm cache dir (melix_fsm.commands.paths) / "calibration". The value "off"
  disables the cache. A file whose stored key differs from the asked key (a hash
  collision, an older layout) or that does not parse is a miss, never an error; a write
  that fails leaves the measurement in use and says nothing (the cache is an optimisation).
- Contexts are bucketed up to a power of two (from PROMPT_LEN, at most MAX_CONTEXT): runs
  of nearby lengths share one calibration, priced at a context at least as long as theirs.
- Reuse is recorded: `fetch` returns where the figures came from, and the caller quotes it
  in the receipt's hardware detail.
- Within one process a small memo spares the disk read.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from melix_fsm.policy.cost_model import TimingTable
from melix_fsm.policy.telemetry import loaded_blas, read_proc_maps

from ..runtime.calibrate import FORWARDS

CACHE_ENV = "MELIX_FSM_CALIBRATION_CACHE"
LAYOUT = 1  # bump when the key or the stored record changes shape
FAILURE_RETRY_S = 300.0  # a failed calibration is not measured again within this, in one process
_MEMO: dict[Path, TimingTable] = {}  # by file: a memo never outlives a change of directory
_FAILED: dict[Path, tuple[float, Any]] = {}  # file -> (when, the typed failure)


def cache_root() -> Path | None:
    """The calibration cache directory, or None when $MELIX_FSM_CALIBRATION_CACHE is "off"."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() == "off":
        return None
    if value:
        return Path(value)
    from melix_fsm.commands.paths import cache_dir

    return cache_dir() / "calibration"


def bucket(context: int, low: int, high: int) -> int:
    """The context a calibration is taken at: the next power of two, within [low, high]."""
    n = max(low, context)
    return min(high, 1 << (n - 1).bit_length())


def blas_regime(maps: str | None = None) -> str:
    """The BLAS that serves mlx's float32 matmuls in this process (telemetry's reading of
    /proc/self/maps: a preloaded OpenBLAS wins over the wheel's reference BLAS, and a copy
    another package vendors, numpy's, is ignored) with its thread settings; where the maps
    cannot be read, the platform's name (macOS: Accelerate). `maps`: None reads this process's."""
    text = read_proc_maps() if maps is None else maps
    if not text:
        return platform.system()
    threads = ",".join(
        f"{v}={os.environ[v]}" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if v in os.environ
    )
    return loaded_blas(text) + (f" [{threads}]" if threads else "")


def machine_facts() -> dict[str, str]:
    """The machine as far as a calibration depends on it."""
    import mlx.core as mx

    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # noqa: BLE001 - older mlx: the platform facts below still key it
        info = {}
    return {
        "system": platform.system(),
        "arch": platform.machine(),
        "device": "cpu" if mx.default_device().type == mx.cpu else "gpu",
        "device_name": str(info.get("device_name", "")),
        "cpu": _cpu_name(),
        "cores": str(os.cpu_count()),
        "blas": blas_regime(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def model_files(path: Path) -> list[list[Any]]:
    """[name, size, mtime_ns] of the checkpoint's weight and config files."""
    files = sorted([*path.glob("*.safetensors"), path / "config.json"])
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("mlx", "mlx-lm", "melix-fsm"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "unknown"
    return out


def key_of(
    model_path: str, *, dtype: str, head: str, batch_size: int, k: int, context: int
) -> dict[str, Any]:
    """Everything a stored calibration must match to be reused."""
    path = Path(model_path).resolve()
    return {
        "layout": LAYOUT,
        "forwards": FORWARDS,  # what the timed forwards were fed (melix_mlx.runtime.calibrate)
        "model": str(path),
        "files": model_files(path) if path.is_dir() else [],
        "dtype": dtype,
        "head": head,
        "versions": versions(),
        "machine": machine_facts(),
        "batch_size": batch_size,
        "k": k,
        "context": context,
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


class CalibrationCache:
    """Stored calibrations under `root` (see the module rules)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def file_of(self, key: dict[str, Any]) -> Path:
        return self.root / f"{_digest(key)}.json"

    def load(self, key: dict[str, Any]) -> TimingTable | None:
        target = self.file_of(key)
        if target in _MEMO:
            return _MEMO[target]
        try:
            record = json.loads(target.read_text(encoding="utf-8"))
            if record.get("key") != json.loads(json.dumps(key)):
                return None
            table = msgspec.convert(record["table"], TimingTable)
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError):
            return None
        _MEMO[target] = table
        return table

    def store(self, key: dict[str, Any], table: TimingTable) -> None:
        target = self.file_of(key)
        _MEMO[target] = table
        record = {"key": key, "table": msgspec.to_builtins(table)}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
            os.replace(partial, target)  # atomic: a reader never sees half a record
        except OSError:
            pass

    def fetch(self, key: dict[str, Any], measure: Callable[[int], Any]) -> tuple[Any, Path | None]:
        """(the calibration, the file it was reused from or None): stored, else
        `measure(context)` (stored when it measured a table)."""
        table = self.load(key)
        if table is not None:
            return table, self.file_of(key)
        target = self.file_of(key)
        failed = _FAILED.get(target)
        if failed is not None and time.monotonic() - failed[0] < FAILURE_RETRY_S:
            return failed[1], None  # the same typed failure: the receipt quotes it again
        result = measure(key["context"])
        if isinstance(result, TimingTable):
            self.store(key, result)
            _FAILED.pop(target, None)
        else:
            _FAILED[target] = (time.monotonic(), result)
        return result, None


def default_cache() -> CalibrationCache | None:
    """The cache at `cache_root()`, or None when it is off."""
    root = cache_root()
    return CalibrationCache(root) if root is not None else None
