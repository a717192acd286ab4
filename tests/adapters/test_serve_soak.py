"""The soak's own checks (benchmarks/soak_serve.py): its RSS slope fit, its mismatch and
status tallies, its reading of error shapes. The soak itself is an opt-in benchmark."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_serve.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slope_is_per_hour_and_leaves_the_warm_up_out(soak) -> None:
    rng = random.Random(0)
    ramp = [(t, 100.0 + t) for t in range(0, 300, 15)]  # warm-up: +1 MB/s
    flat = [(t, 400.0 + rng.uniform(-2, 2)) for t in range(300, 3600, 15)]
    assert abs(soak.slope_per_hour(ramp + flat, after_s=300)) < 5.0
    assert soak.slope_per_hour(ramp + flat) > 50.0  # with the ramp, the fit is not flat
    leak = [(t, 400.0 + t / 60) for t in range(0, 3600, 15)]  # 1 MB a minute
    assert soak.slope_per_hour(leak) == pytest.approx(60.0)
    assert soak.slope_per_hour(leak[:2]) is None  # too few samples to say


def test_tally_counts_mismatches_and_unexpected_statuses(soak) -> None:
    tally = soak.Tally()
    assert tally.same("completion_whole", (200, "abc"), (200, "abc"))
    assert not tally.same("seeded_stream", (200, "abd"), (200, "abc"))
    assert tally.status("bad_n2", 400, 400)
    assert not tally.status("bad_n2", 500, 400)
    tally.failed("exception", ConnectionResetError("reset"))
    assert len(tally.mismatches) == 1 and "seeded_stream" in tally.mismatches[0]
    assert len(tally.unexpected) == 2 and "status 500" in tally.unexpected[0]


def test_error_shapes_per_api(soak) -> None:
    openai_error = b'{"error": {"message": "m", "type": "t", "param": null, "code": null}}'
    anthropic_error = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}'
    assert soak.error_shaped("/v1/completions", openai_error)
    assert not soak.error_shaped("/v1/completions", anthropic_error)
    assert soak.error_shaped("/v1/messages", anthropic_error)
    assert not soak.error_shaped("/v1/messages", openai_error)
    assert not soak.error_shaped("/v1/completions", b"<html>")
