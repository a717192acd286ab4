"""Shared test configuration: Hypothesis profiles.

Rules of this file:
- Profiles are chosen with the environment variable HYPOTHESIS_PROFILE ("default" when
  unset): "default" keeps the whole suite quick enough for CI and a shared 2-core machine,
  "deep" is the long soak (HYPOTHESIS_PROFILE=deep pytest tests/core/test_stateful.py).
- Failures always print a reproduction blob (`@reproduce_failure`) and runs are not
  derandomized, so each run explores new examples; the seed is printed with the
  statistics header below so a failing run can be repeated with `--hypothesis-seed`.
- Every test gets its own calibration cache directory (MELIX_FSM_CALIBRATION_CACHE, which
  subprocesses inherit): a calibration stored by an earlier test or an earlier run on this
  machine is never reused unless a test arranges it.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,  # shared CI machines stall; timing is the benchmarks' job
    "print_blob": True,
    "derandomize": False,
}

settings.register_profile(
    "default",
    max_examples=60,
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow],
    **_COMMON,
)
settings.register_profile(
    "deep",
    max_examples=2000,
    stateful_step_count=60,
    suppress_health_check=[HealthCheck.too_slow],
    **_COMMON,
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Draw a fresh seed per session (runs stay random) but force it on every Hypothesis
    # test, so the header below can name it and `--hypothesis-seed=N` replays the run.
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(2**32))


@pytest.fixture(autouse=True)
def _own_calibration_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MELIX_FSM_CALIBRATION_CACHE", str(tmp_path_factory.mktemp("calibration")))


def pytest_report_header(config: pytest.Config) -> list[str]:
    seed = config.getoption("hypothesis_seed", None)
    return [
        f"hypothesis profile: {PROFILE} (HYPOTHESIS_PROFILE=deep for the long soak)",
        f"hypothesis seed: {seed} (replay with --hypothesis-seed={seed})",
    ]
