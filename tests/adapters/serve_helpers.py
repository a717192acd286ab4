"""Shared by the serve tests: a server started for a test, raw HTTP, the openai client.

Every wait is bounded (TIMEOUT_S on each socket operation, deadlines on polls).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TIMEOUT_S = 60.0


@contextmanager
def serving(served: Any, **options: Any) -> Iterator[Any]:
    from melix_mlx.serve.app import start_server

    running = start_server(served, **options)
    try:
        yield running
    finally:
        running.stop()


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: (status, lower-cased headers, body)."""
    host, port = host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        sent = {"Content-Type": "application/json"} if body is not None else {}
        sent.update(headers or {})
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def post_json(url: str, path: str, payload: Any, **kw: Any) -> tuple[int, dict[str, str], Any]:
    status, headers, body = raw(url, "POST", path, json.dumps(payload).encode(), **kw)
    return status, headers, json.loads(body) if body else None


def assert_error_shape(payload: Any) -> None:
    """The one OpenAI error object every refusal uses."""
    assert set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


def client(url: str, api_key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, timeout=TIMEOUT_S, max_retries=0)


def healthy(url: str) -> bool:
    status, _, body = raw(url, "GET", "/health")
    return status == 200 and json.loads(body) == {"status": "ok"}


def wait_until(predicate: Any, timeout: float = 20.0, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = raw(url, "GET", "/metrics", headers=headers)
    assert status == 200
    total = 0.0
    found = False
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            if key == name:
                total += sample.value
                found = True
    if not found:
        raise KeyError(name)
    return total
