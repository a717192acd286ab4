"""The server's memory by layer is on /metrics, malloc's free pages go back, mlx's cache is bounded.

A soak's RSS follows glibc's heap, not the live bytes (docs/serving.md, "An hour under
load"): these tests check the pieces that show and bound it. A real loopback server
exports mlx's, malloc's and the kernel's figures and trims on its generation thread at the
configured interval; a trim returns free pages that a live block at the heap's top pinned
(a fresh process, so the heap is the test's own); `--mlx-cache-limit` is applied before
anything is loaded and bounds what mlx keeps.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from melix_mlx.serve import memory  # noqa: E402
from serve_helpers import metric, serving, wait_until  # noqa: E402  (tests/adapters is on sys.path)

from melix_fsm.cli import main  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
glibc = pytest.mark.skipif(memory._MALLOC_TRIM is None, reason="not glibc's malloc")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@glibc
def test_trim_runs_once_per_interval() -> None:
    clock = FakeClock()
    trim = memory.MemoryTrim(10.0, clock=clock)
    assert not trim.tick() and trim.trims == 0  # the interval counts from the start
    clock.now += 9.9
    assert not trim.tick()
    clock.now += 0.2
    assert trim.tick() and trim.trims == 1
    assert not trim.tick()  # and again from that trim
    clock.now += 10.0
    assert trim.tick() and trim.trims == 2
    never = memory.MemoryTrim(0.0, clock=clock)
    clock.now += 1e6
    assert not never.tick() and never.trims == 0
    with pytest.raises(ValueError, match=">= 0"):
        memory.MemoryTrim(-1.0)


@glibc
def test_trim_returns_pages_a_live_block_pinned() -> None:
    # 64 MB of heap blocks (below malloc's mmap threshold), all freed but a block above them:
    # glibc cannot shrink the heap past that block, so the pages stay resident until a trim
    script = textwrap.dedent(
        """
        import ctypes, sys
        sys.path[:0] = %r
        from melix_mlx.serve import memory
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 32 KB blocks stay in the heap
        blocks = [libc.malloc(32 << 10) for _ in range(2048)]
        for b in blocks:
            ctypes.memset(b, 1, 32 << 10)
        pin = libc.malloc(64)
        for b in blocks:
            libc.free(b)
        trim = memory.MemoryTrim(1.0)  # made first: nothing allocates between the two readings
        held = memory.resident_bytes()
        trim.trim()
        after = memory.resident_bytes()  # read before print's own allocations
        print(held - after, trim.released, trim.trims)
        """
    ) % (sys.path,)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dropped, released, trims = map(int, out.stdout.split())
    assert dropped > 48 << 20, dropped  # most of the 64 MB went back
    # the trim's own readings and the script's are a few statements apart: the interpreter
    # may touch a page or two between them (it did, either way, on this machine)
    assert abs(released - dropped) <= 16 * 4096 and trims == 1, (released, dropped)


@pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")
def test_server_exports_memory_and_trims_on_its_generation_thread() -> None:
    from melix_mlx.serve.limits import ServeLimits
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(None, 2, "force_on")
    began = time.monotonic()
    with serving(served, max_batch_size=1, limits=ServeLimits(memory_trim_s=0.2)) as running:
        url = running.url
        weights = sum(v.nbytes for _, v in _leaves(served.model.parameters()))
        assert metric(url, "melix_mlx_active_memory_bytes") >= weights > 0
        assert metric(url, "melix_mlx_peak_memory_bytes") >= metric(url, "melix_mlx_active_memory_bytes")
        assert metric(url, "melix_mlx_cache_memory_bytes") >= 0
        assert metric(url, "melix_python_gc_objects") > 1000
        if memory.resident_bytes() is not None:
            assert metric(url, "melix_process_resident_bytes") > weights
        if memory._MALLOC_TRIM is not None:
            assert metric(url, "melix_malloc_in_use_bytes") > 0
            assert metric(url, "melix_memory_trim_interval_seconds") == 0.2
            # the idle loop turns every 0.1 s: trims follow at the interval, not before
            assert wait_until(lambda: metric(url, "melix_memory_trims") >= 3, timeout=20)
            assert metric(url, "melix_memory_trims") <= 1 + (time.monotonic() - began) / 0.2
            assert running.generator.memory_trim.interval_s == 0.2


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    if isinstance(tree, list):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, f"{prefix}.{i}")]
    return [(prefix, tree)]


def test_cache_limit_bounds_what_mlx_keeps() -> None:
    import mlx.core as mx

    previous = memory.apply_cache_limit(1 << 20)
    try:
        for n in (1 << 18, 1 << 19, 3 << 18):  # 1, 2, 3 MB of float32, each freed at once
            mx.eval(mx.ones((n,)))
            assert mx.get_cache_memory() <= 1 << 20
        assert memory._applied == [1 << 20]
        with pytest.raises(ValueError, match=">= 0"):
            memory.apply_cache_limit(-1)
    finally:
        memory.apply_cache_limit(previous)
        memory._applied.clear()


def test_cache_limit_flag_is_applied_before_loading(monkeypatch, capsys) -> None:
    import melix_mlx.commands.serve as command
    from melix_mlx.serve.provider import ServeError

    order: list[Any] = []
    monkeypatch.setattr(memory, "apply_cache_limit", lambda n: order.append(n) or 0)

    def load(args: Any) -> Any:
        order.append("load")
        raise ServeError("stopped by the test")

    monkeypatch.setattr(command, "load_from_args", load)
    assert main(["serve", "--port", "0", "--mlx-cache-limit", "48"]) == 2
    assert order == [48 << 20, "load"]
    order.clear()
    assert main(["serve", "--port", "0"]) == 2  # no flag: mlx's own bound is left alone
    assert order == ["load"]
    assert main(["serve", "--port", "0", "--mlx-cache-limit", "-1"]) == 2
    assert main(["serve", "--port", "0", "--memory-trim-interval", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--mlx-cache-limit must be >= 0" in err and "--memory-trim-interval must be >= 0" in err
