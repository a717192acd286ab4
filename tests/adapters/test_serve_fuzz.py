"""Fuzz the served OpenAPI schema: no input gets a 5xx, every error has the one shape, and
the server is healthy and still answering correctly afterwards.

schemathesis generates requests (valid and invalid: negative mode) from the schema the
real server serves at /openapi.json, against that server on a loopback port. Profiles:
the default run is short (CI); `-m slow` runs the deep one. Both bound max_tokens and
the prompt so a valid request ends quickly.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, settings  # noqa: E402
from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import client, healthy, serving  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
CI_EXAMPLES, DEEP_EXAMPLES = 60, 1500
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def fuzz_url() -> Any:
    from melix_mlx.serve.limits import ServeLimits
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(None, 2, "force_on")
    limits = ServeLimits(max_tokens_limit=4, max_prompt_tokens=256, request_timeout_s=30)
    with serving(served, max_batch_size=4, limits=limits) as running:
        yield running.url


def check(case: Any, url: str) -> None:
    response = case.call(base_url=url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    if response.status_code >= 400:
        payload = json.loads(response.text)
        if case.path.startswith("/v1/messages"):  # the Anthropic Messages API's own shape
            assert set(payload) == {"type", "error"} and set(payload["error"]) == {"type", "message"}
        else:
            assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}


def fuzz(url: str, examples: int) -> None:
    """Every operation of the served schema, valid and invalid cases (Hypothesis drives it:
    schemathesis' pytest plugin does not load with pytest 9)."""
    from hypothesis import given
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/messages",
             "/v1/messages/count_tokens"}
    assert {op.path for op in operations} >= paths
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    strategy = st.one_of([op.as_strategy(generation_mode=mode) for op in operations for mode in modes])

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=strategy)
    def run(case: Any) -> None:
        check(case, url)

    run()


def test_fuzz_no_5xx(fuzz_url: str) -> None:
    fuzz(fuzz_url, CI_EXAMPLES)


@pytest.mark.slow
def test_fuzz_no_5xx_deep(fuzz_url: str) -> None:
    fuzz(fuzz_url, DEEP_EXAMPLES)


def test_healthy_and_exact_after_the_fuzz(fuzz_url: str) -> None:
    assert healthy(fuzz_url)
    request = {"model": "stdlib-tiny", "prompt": "The king of", "max_tokens": 4, "temperature": 0}
    first = client(fuzz_url).completions.create(**request)
    again = client(fuzz_url).completions.create(**request)
    assert first.usage.completion_tokens == 4 and first.choices[0].text == again.choices[0].text
