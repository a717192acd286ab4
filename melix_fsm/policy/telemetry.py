"""Hardware priors: what the platform suggests about the cost of verifying k+1 tokens.

Rules of this module:
- A prior is only a starting guess, recorded in the receipt next to the measurement that
  overrides it. The same machine can be compute-bound with one BLAS and bandwidth-bound
  with another (BENCHMARKS.md reports both regimes on one CPU), so nothing here decides alone.
- Everything that touches the system goes through an injected reader: `sysctl` (the
  Apple chip name) and `maps` (the text of /proc/self/maps). The default readers are the
  only code that shells out or opens files; tests always inject fakes.
- The default sysctl reader runs `sysctl -n machdep.cpu.brand_string` only on darwin.
- Pure otherwise: no mlx import, no clock.
"""

from __future__ import annotations

import enum
import re
import subprocess
import sys
from collections.abc import Callable

import msgspec


class Regime(enum.StrEnum):
    """Whether a forward over a few more tokens costs more (compute) or the same (bandwidth)."""

    compute_bound = "compute_bound"  # 2 tokens cost ~2x one: MTP usually loses
    bandwidth_bound = "bandwidth_bound"  # 1..4 tokens cost ~the same: MTP pays
    intermediate = "intermediate"  # in between (e.g. bfloat16 on a CPU)
    unknown = "unknown"


# Assumed cost of a 2-token forward relative to a 1-token forward, per regime. The
# compute-bound and intermediate figures are the ones measured on the reference-BLAS
# mlx-cpu wheel (float32 ~1.8x, bfloat16 ~1.25-1.4x); bandwidth-bound is "about free".
COST_RATIO_2: dict[Regime, float | None] = {
    Regime.compute_bound: 1.8,
    Regime.intermediate: 1.35,
    Regime.bandwidth_bound: 1.05,
    Regime.unknown: None,
}


class HardwarePrior(msgspec.Struct, frozen=True, kw_only=True):
    """The platform's guess, as the receipt records it."""

    platform: str  # "apple_gpu" | "apple_cpu" | "linux_cpu" | "cuda" | "other"
    chip: str | None = None  # Apple brand string or CUDA device name
    blas: str | None = None  # linux_cpu: "openblas" | "mkl" | "blis" | "reference" | "unknown"
    dtype: str = "float32"
    expected_regime: Regime = Regime.unknown
    cost_ratio_2: float | None = None  # assumed t(2-token forward) / t(1-token forward)
    note: str = ""

    @property
    def admits_before_measurement(self) -> bool:
        """Whether the prior alone would lean towards speculation (never decides alone)."""
        return self.expected_regime is Regime.bandwidth_bound


def _prior(platform: str, regime: Regime, note: str, **kw: object) -> HardwarePrior:
    return HardwarePrior(
        platform=platform, expected_regime=regime, cost_ratio_2=COST_RATIO_2[regime], note=note, **kw
    )


# ---- Apple Silicon ----------------------------------------------------------------

_APPLE_CHIP = re.compile(r"\bApple\s+M(\d+)(?:\s+(Pro|Max|Ultra))?\b", re.IGNORECASE)


def apple_prior(brand: str, dtype: str = "float32") -> HardwarePrior:
    """Prior for an Apple GPU from `sysctl -n machdep.cpu.brand_string` (e.g. "Apple M2 Pro").

    M1/M2 base and Pro GPUs run out of compute before bandwidth on small verify batches,
    so they start compute-bound (speculation off until measured); Max/Ultra (many more
    GPU cores) and every M3+ start bandwidth-bound.
    """
    brand = brand.strip()
    m = _APPLE_CHIP.search(brand)
    if m is None:
        return _prior(
            "apple_gpu", Regime.unknown, f"unrecognised chip name {brand!r}", chip=brand, dtype=dtype
        )
    generation, tier = int(m.group(1)), (m.group(2) or "base").lower()
    if generation <= 2 and tier in ("base", "pro"):
        regime, why = Regime.compute_bound, f"M{generation} {tier}: compute-bound until measured"
    else:
        regime, why = Regime.bandwidth_bound, f"M{generation} {tier}: bandwidth-bound"
    return _prior("apple_gpu", regime, why, chip=brand, dtype=dtype)


# ---- Linux CPU ----------------------------------------------------------------------

# Bundled copies whose symbols are suffixed (numpy's scipy_openblas64_) serve only their
# own wheel, never mlx: they must not count as "the process uses OpenBLAS".
_IGNORED_LIBS = ("scipy_openblas",)
_BLAS_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Checked on the full path, in this order: Debian's alternatives put OpenBLAS's
    # libblas.so.3 under .../openblas-pthread/, which must read as openblas, not reference.
    ("openblas", re.compile(r"openblas", re.IGNORECASE)),
    ("mkl", re.compile(r"libmkl", re.IGNORECASE)),
    ("blis", re.compile(r"libblis", re.IGNORECASE)),
    ("reference", re.compile(r"/libc?blas[-.]", re.IGNORECASE)),
)


def loaded_blas(maps_text: str) -> str:
    """Which BLAS the process mapped, from the text of /proc/self/maps.

    Returns "openblas", "mkl", "blis", "reference" (netlib libblas/libcblas, e.g. the one
    the mlx-cpu wheel bundles) or "unknown". An optimised BLAS wins over a reference one
    mapped alongside it: that is the LD_PRELOAD case, where the preloaded library's
    symbols resolve first.
    """
    paths = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and not any(ig in parts[5] for ig in _IGNORED_LIBS):
            paths.append(parts[5])
    for name, pattern in _BLAS_PATTERNS:
        if any(pattern.search(p) for p in paths):
            return name
    return "unknown"


def linux_cpu_prior(blas: str, dtype: str = "float32") -> HardwarePrior:
    """Prior for mlx on a Linux CPU from the loaded BLAS and the compute dtype."""
    if dtype != "float32":
        # BLAS sgemm serves float32 only; half-precision matmuls take mlx's own kernels
        # whatever BLAS is loaded (measured ~1.25-1.4x for 2 tokens on this project's CI).
        return _prior(
            "linux_cpu", Regime.intermediate, f"{dtype}: mlx kernels, not BLAS", blas=blas, dtype=dtype
        )
    if blas in ("openblas", "mkl", "blis"):
        return _prior("linux_cpu", Regime.bandwidth_bound, f"{blas} float32", blas=blas, dtype=dtype)
    if blas == "reference":
        return _prior("linux_cpu", Regime.compute_bound, "reference BLAS float32", blas=blas, dtype=dtype)
    return _prior(
        "linux_cpu", Regime.unknown, "no BLAS library recognised in /proc/self/maps", blas=blas, dtype=dtype
    )


# ---- CUDA and the dispatcher ------------------------------------------------------


def cuda_prior(device_name: str | None = None, dtype: str = "float16") -> HardwarePrior:
    """Decode on a datacenter or consumer GPU is memory-bound at small batch sizes."""
    return _prior(
        "cuda", Regime.bandwidth_bound, "GPU decode is bandwidth-bound", chip=device_name, dtype=dtype
    )


def read_sysctl_brand() -> str | None:
    """The default Apple chip reader: None off darwin or when sysctl fails."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def read_proc_maps() -> str:
    """The default Linux BLAS reader: the text of /proc/self/maps, or "" when unreadable."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def detect(
    *,
    platform: str | None = None,
    device: str = "gpu",
    dtype: str = "float32",
    sysctl: Callable[[], str | None] = read_sysctl_brand,
    maps: Callable[[], str] = read_proc_maps,
    gpu_name: str | None = None,
) -> HardwarePrior:
    """The prior for this process.

    platform: `sys.platform` unless given. device: mlx's default device type, "gpu" or
    "cpu" (the caller reads it from mlx; this module does not import mlx). On Linux a
    "gpu" device is CUDA.
    """
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        brand = sysctl()
        if device == "cpu":
            return _prior(
                "apple_cpu", Regime.unknown, "mlx on the Apple CPU: measure", chip=brand, dtype=dtype
            )
        if brand is None:
            return _prior("apple_gpu", Regime.unknown, "chip name unavailable", dtype=dtype)
        return apple_prior(brand, dtype)
    if platform.startswith("linux"):
        if device == "gpu":
            return cuda_prior(gpu_name, dtype)
        return linux_cpu_prior(loaded_blas(maps()), dtype)
    return _prior("other", Regime.unknown, f"no prior for platform {platform!r}", dtype=dtype)
