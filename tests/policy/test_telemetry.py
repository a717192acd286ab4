"""Hardware priors from faked sysctl output and faked /proc/self/maps contents."""

from __future__ import annotations

import pytest

from melix_fsm.policy.telemetry import Regime, apple_prior, detect, linux_cpu_prior, loaded_blas


def _no_shell():
    raise AssertionError("tests must never read the real system")


@pytest.mark.parametrize(
    "brand, regime",
    [
        ("Apple M1", Regime.compute_bound),
        ("Apple M1 Pro", Regime.compute_bound),
        ("Apple M2", Regime.compute_bound),
        ("Apple M2 Pro", Regime.compute_bound),
        ("Apple M1 Max", Regime.bandwidth_bound),
        ("Apple M2 Ultra", Regime.bandwidth_bound),
        ("Apple M3", Regime.bandwidth_bound),
        ("Apple M3 Pro", Regime.bandwidth_bound),
        ("Apple M4 Max\n", Regime.bandwidth_bound),
        ("Intel(R) Core(TM) i9-9980HK CPU @ 2.40GHz", Regime.unknown),
    ],
)
def test_apple_chips(brand, regime):
    prior = detect(platform="darwin", device="gpu", sysctl=lambda: brand, maps=_no_shell)
    assert prior.platform == "apple_gpu" and prior.expected_regime is regime
    assert prior.chip == brand.strip()
    assert prior.admits_before_measurement == (regime is Regime.bandwidth_bound)


def test_apple_without_sysctl_and_apple_cpu():
    assert detect(platform="darwin", sysctl=lambda: None, maps=_no_shell).expected_regime is Regime.unknown
    cpu = detect(platform="darwin", device="cpu", sysctl=lambda: "Apple M3", maps=_no_shell)
    assert cpu.platform == "apple_cpu" and cpu.expected_regime is Regime.unknown


def _maps(*paths: str) -> str:
    return (
        "".join(f"7f34dc{i:06x}-7f34dc{i + 1:06x} r-xp 00000000 fe:00 {i} {p}\n" for i, p in enumerate(paths))
        + "7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]\n"
    )


MLX_BLAS = "/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
NUMPY_BLAS = "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
PRELOADED = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


@pytest.mark.parametrize(
    "paths, blas",
    [
        ((MLX_BLAS,), "reference"),
        ((MLX_BLAS, NUMPY_BLAS), "reference"),  # numpy's suffixed copy serves numpy only
        ((MLX_BLAS, PRELOADED), "openblas"),  # LD_PRELOAD: its symbols resolve first
        (("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",), "openblas"),  # alternatives
        (("/opt/intel/oneapi/mkl/lib/libmkl_rt.so.2",), "mkl"),
        (("/usr/lib/libcblas.so.3",), "reference"),
        (("/usr/lib/libc.so.6",), "unknown"),
        ((), "unknown"),
    ],
)
def test_linux_blas_from_maps(paths, blas):
    assert loaded_blas(_maps(*paths)) == blas


def test_linux_cpu_priors():
    ref = detect(platform="linux", device="cpu", sysctl=_no_shell, maps=lambda: _maps(MLX_BLAS))
    assert ref.platform == "linux_cpu" and ref.blas == "reference"
    assert ref.expected_regime is Regime.compute_bound and ref.cost_ratio_2 == 1.8
    fast = detect(platform="linux", device="cpu", sysctl=_no_shell, maps=lambda: _maps(MLX_BLAS, PRELOADED))
    assert fast.expected_regime is Regime.bandwidth_bound
    assert linux_cpu_prior("reference", "bfloat16").expected_regime is Regime.intermediate
    assert linux_cpu_prior("openblas", "bfloat16").expected_regime is Regime.intermediate
    assert linux_cpu_prior("unknown").expected_regime is Regime.unknown


def test_cuda_and_other():
    cuda = detect(platform="linux", device="gpu", gpu_name="H200", sysctl=_no_shell, maps=_no_shell)
    assert cuda.platform == "cuda" and cuda.expected_regime is Regime.bandwidth_bound and cuda.chip == "H200"
    other = detect(platform="win32", sysctl=_no_shell, maps=_no_shell)
    assert other.platform == "other" and other.expected_regime is Regime.unknown


def test_apple_prior_direct():
    assert apple_prior("Apple M2 Max", "bfloat16").dtype == "bfloat16"
