"""The server process's memory, read when /metrics is scraped, and mlx's buffer-cache bound.

Rules of this module:
- Every series is read at scrape time from its owner, never kept here: mlx's allocator
  (active, cache, peak bytes and the cache limit), the kernel (resident bytes,
  /proc/self/statm), glibc's malloc (bytes in use and free bytes it holds, `mallinfo2`)
  and Python's collector (objects it tracks). A source this platform lacks is left out,
  never reported as zero. Together they say which layer a growing RSS lives in.
- mlx keeps freed buffers in a cache for reuse, and its limit defaults to its memory
  limit (about the machine's RAM): a server that meets many array shapes (batch sizes,
  KV lengths) holds what it freed at its largest. `apply_cache_limit` bounds it; the
  command applies `--mlx-cache-limit` (melix_mlx.commands.serve) at start, before any
  request. The limit is process-wide, so only the process's owner sets it.
- glibc's malloc keeps freed memory inside its heap (a live block near the heap's top pins
  the free pages below it), so the resident set follows the heap's high-water mark, not
  the live bytes: what a burst of long rows freed stays resident until the heap's top is
  free again. `MemoryTrim` asks malloc to return its free pages (`malloc_trim(0)`) every
  `interval_s` seconds of the generation thread (`--memory-trim-interval`; 0 never); a
  platform without glibc's malloc has nothing to trim. Its trims, seconds and the
  resident bytes they returned are gauges too.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo() -> Any:
    """glibc's `mallinfo2` (None elsewhere)."""
    try:
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def _malloc_trim() -> Any:
    """glibc's `malloc_trim` (None elsewhere)."""
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


_MALLINFO = _mallinfo()
_MALLOC_TRIM = _malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def gauge(name: str, text: str, value: float) -> Any:
    """One unlabelled gauge, as a custom collector yields it."""
    family = GaugeMetricFamily(name, text)
    family.add_metric([], float(value))
    return family


def resident_bytes() -> int | None:
    """This process's resident set (Linux's /proc/self/statm), None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def readings() -> dict[str, tuple[str, float]]:
    """{metric name: (help, value)} of every source this platform has."""
    import mlx.core as mx

    out = {
        "melix_mlx_active_memory_bytes": ("Bytes of live mlx arrays", mx.get_active_memory()),
        "melix_mlx_cache_memory_bytes": ("Bytes mlx holds freed, for reuse", mx.get_cache_memory()),
        "melix_mlx_peak_memory_bytes": (
            "The most bytes of live mlx arrays since start",
            mx.get_peak_memory(),
        ),
        "melix_python_gc_objects": ("Objects tracked by Python's collector", len(gc.get_objects())),
    }
    rss = resident_bytes()
    if rss is not None:
        out["melix_process_resident_bytes"] = ("The process's resident set", rss)
    if _MALLINFO is not None:
        info = _MALLINFO()
        out["melix_malloc_in_use_bytes"] = (
            "Bytes malloc has handed out and not got back",
            info.uordblks + info.hblkhd,
        )
        out["melix_malloc_free_bytes"] = ("Bytes free inside malloc's heap, not returned", info.fordblks)
    return out


class MemoryTrim:
    """Returns malloc's free pages to the system every `interval_s` seconds (`tick`, called
    by the generation thread each turn of its loop, busy or idle)."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"a memory trim interval must be >= 0 s, got {interval_s}")
        self.interval_s = interval_s
        self.available = _MALLOC_TRIM is not None
        self.clock = clock
        self.last = clock()
        self.trims = 0
        self.seconds = 0.0
        self.released = 0  # resident bytes the trims returned

    def tick(self) -> bool:
        """Trim if the interval has passed since the last trim; True when it trimmed."""
        if not self.interval_s or not self.available or self.clock() - self.last < self.interval_s:
            return False
        self.trim()
        return True

    def trim(self) -> None:
        before = resident_bytes() or 0
        began = time.perf_counter()
        _MALLOC_TRIM(0)
        self.seconds += time.perf_counter() - began
        self.released += max(0, before - (resident_bytes() or before))
        self.trims += 1
        self.last = self.clock()

    def collect(self) -> Iterator[Any]:
        for name, text, value in (
            ("melix_memory_trims", "Times malloc's free pages were returned to the system", self.trims),
            ("melix_memory_trim_seconds", "Seconds spent returning malloc's free pages", self.seconds),
            ("melix_memory_trim_released_bytes", "Resident bytes the trims returned", self.released),
            (
                "melix_memory_trim_interval_seconds",
                "Seconds between trims (0: never)",
                self.interval_s if self.available else 0.0,
            ),
        ):
            yield gauge(name, text, value)


_applied: list[int] = []  # the cache limit this process applied last (none: mlx's default)


class MemoryCollector:
    """The readings above as gauges, on a server's registry (melix_mlx.serve.metrics)."""

    def collect(self) -> Iterator[Any]:
        for name, (text, value) in readings().items():
            yield gauge(name, text, value)
        if _applied:
            yield gauge("melix_mlx_cache_limit_bytes", "The bound on mlx's buffer cache", _applied[-1])


def apply_cache_limit(limit_bytes: int) -> int:
    """Bound mlx's buffer cache at `limit_bytes` (0: no cache) and return what it was; what it
    holds beyond the bound is returned now."""
    import mlx.core as mx

    if limit_bytes < 0:
        raise ValueError(f"an mlx cache limit must be >= 0 bytes, got {limit_bytes}")
    previous = mx.set_cache_limit(limit_bytes)
    _applied[:] = [limit_bytes]
    if mx.get_cache_memory() > limit_bytes:
        mx.clear_cache()
    return previous
