"""The conformance kit's pytest plugin: a `conformance` fixture and a report header line.

Rules of this module:
- Not registered as a `pytest11` entry point (an auto-loaded plugin would run in every
  pytest session of the environment, and registering it twice, by entry point and by
  `pytest_plugins`, makes pytest refuse to start). Enable it in your root conftest.py:
  `pytest_plugins = ["melix_fsm.testing.pytest_plugin"]`, or import the fixture.
- `conformance(generator_factory, reference=None, **options)` is `run_conformance` with
  the session's profile: `MELIX_CONFORMANCE_PROFILE` ("quick", the default, or "deep").
  Seeds: under pytest, Hypothesis's `--hypothesis-seed=N` fixes every run; otherwise each
  run draws a seed and names it in its failure message.
- No mlx import: the fixture hands the kit the caller's factory and reference as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from .machine import PROFILE_ENV, profile_settings, run_conformance


@pytest.fixture
def conformance() -> Callable[..., None]:
    """`run_conformance` bound to the session's conformance profile."""

    def run(generator_factory: Callable[..., Any], reference: Any = None, **options: Any) -> None:
        options.setdefault("settings", profile_settings())
        run_conformance(generator_factory, reference, **options)

    return run


def pytest_report_header(config: pytest.Config) -> list[str]:
    name = os.environ.get(PROFILE_ENV, "quick")
    return [f"melix conformance profile: {name} ({PROFILE_ENV}=deep for >= 2000 examples)"]
