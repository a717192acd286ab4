"""The HTTP front refuses what could hurt it, in one error shape, and keeps serving.

Real servers (uvicorn) on 127.0.0.1 ephemeral ports, raw http.client and the openai
client; every wait bounded. Each probe of issue 35 is here: an out-of-vocabulary
logit_bias (it used to kill the process), too many logit_bias keys, n, an empty
prompt, bad JSON, invalid UTF-8, text/plain bodies, the body limit, the prompt-token
limit, auth, CORS, privacy of every response, the queue limit (429 + Retry-After).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import (  # noqa: E402  (tests/adapters is on sys.path)
    assert_error_shape,
    client,
    healthy,
    metric,
    post_json,
    raw,
    serving,
    wait_until,
)

CKPT = EMBEDDED["stdlib-tiny"]
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://allowed.example"
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def served() -> Any:
    from melix_mlx.serve.provider import load_served_model

    return load_served_model(None, 2, "force_on")


@pytest.fixture(scope="module")
def url(served: Any) -> Any:
    from melix_mlx.serve.limits import ServeLimits

    limits = ServeLimits(max_body_bytes=64 * 1024, max_prompt_tokens=256, max_tokens_limit=512)
    with serving(served, max_batch_size=4, limits=limits) as running:
        yield running.url


@pytest.fixture(scope="module")
def secured(served: Any) -> Any:
    with serving(served, max_batch_size=2, api_key=KEY, allowed_origins=[ORIGIN]) as running:
        yield running.url


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "The king of", "max_tokens": 4, "temperature": 0, **fields}


# -- no request can crash the process ---------------------------------------------------------
@pytest.mark.parametrize(
    "bias",
    [{"99999999": 5.0}, {"1024": 1.0}, {"-1": 1.0}, {"abc": 1.0}, {"1e3": 1.0}, {"5": "x"}, {"5": True},
     {str(i): 1.0 for i in range(301)}, [1, 2]],
)
def test_bad_logit_bias_is_a_400_and_the_server_lives(url: str, bias: Any) -> None:
    status, _, payload = post_json(url, "/v1/completions", completion(logit_bias=bias))
    assert status == 400, payload
    assert_error_shape(payload)
    assert payload["error"]["param"] == "logit_bias"
    assert healthy(url)


def test_logit_bias_inside_the_vocabulary_acts(url: str) -> None:
    plain = client(url).completions.create(model="stdlib-tiny", **completion())
    forced = client(url).completions.create(model="stdlib-tiny", **completion(logit_bias={"1023": 100.0}))
    assert forced.usage.completion_tokens == 4 and forced.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 513}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"top_logprobs": 12}, "top_logprobs"),
        ({"top_k": 1024, "temperature": 1}, "top_k"),
        ({"xtc_probability": 0.5, "xtc_threshold": 0.6}, "xtc_threshold"),
        ({"temperature": float("nan")}, "temperature"),
        ({"num_draft_tokens": 7}, "num_draft_tokens"),
        ({"adapters": "/tmp/x"}, "adapters"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_fields_are_400_naming_the_field(url: str, fields: dict, param: str) -> None:
    body = json.dumps(completion(**fields), allow_nan=True).encode()
    status, _, payload = raw(url, "POST", "/v1/completions", body)
    payload = json.loads(payload)
    assert status == 400, payload
    assert_error_shape(payload)
    assert payload["error"]["param"] == param


def test_empty_messages_and_empty_chat_are_400(url: str) -> None:
    for messages in ([], [{"content": "no role"}], [{"role": "user", "content": 5}]):
        status, _, payload = post_json(url, "/v1/chat/completions", {"messages": messages})
        assert status == 400 and payload["error"]["param"] == "messages", payload


@pytest.mark.parametrize(
    "content",
    [[1, 2], [{"type": "foo"}], [{"type": "text", "text": 5}],
     [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]],
)
def test_content_parts_other_than_text_are_400(url: str, content: Any) -> None:
    """[1, 2] used to kill mlx-lm's generation loop (it reads parts outside its guard)."""
    messages = [{"role": "user", "content": content}]
    status, _, payload = post_json(url, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and payload["error"]["param"] == "messages", payload
    assert healthy(url)
    text_part = [{"type": "text", "text": "Tell me a story"}]
    status, _, payload = post_json(url, "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": text_part}], "max_tokens": 2})
    assert status == 200, payload


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"\xff\xfe\xfd", b'{"prompt": "\xc3\x28"}', b"", b"[" * 100_000 + b"]" * 100_000],
)
def test_bad_bodies_are_400(url: str, body: bytes) -> None:
    status, headers, payload = raw(url, "POST", "/v1/completions", body)
    assert status in (400, 413), (status, payload)
    assert headers["content-type"].startswith("application/json")
    assert_error_shape(json.loads(payload))
    assert healthy(url)


def test_body_limit_is_413_even_when_announced_huge(url: str) -> None:
    big = json.dumps(completion(prompt="a " * 40_000)).encode()
    status, _, payload = raw(url, "POST", "/v1/completions", big)
    assert status == 413 and json.loads(payload)["error"]["type"] == "invalid_request_error"
    huge = {"Content-Length": "100000000000"}  # announced, never sent: refused before reading
    status, _, payload = raw(url, "POST", "/v1/completions", b"{}", headers=huge)
    assert status in (400, 413)


def test_prompt_token_limit_is_a_400(url: str) -> None:
    with pytest.raises(openai.BadRequestError, match="at most 256"):
        client(url).completions.create(model="stdlib-tiny", **completion(prompt="the king " * 200))
    assert healthy(url)


def test_post_bodies_must_be_json(url: str) -> None:
    body = json.dumps(completion()).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
        status, _, payload = raw(url, "POST", "/v1/completions", body, headers={"Content-Type": kind})
        assert status == 415, kind
        assert_error_shape(json.loads(payload))


def test_unknown_routes_and_methods_share_the_error_shape(url: str) -> None:
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v1/nothing"), ("DELETE", "/v1/completions")):
        status, _, payload = raw(url, method, path, b"{}" if method != "GET" else None)
        assert status in (404, 405)
        assert_error_shape(json.loads(payload))
        assert "/work" not in payload.decode() and str(CKPT) not in payload.decode()


# -- privacy ---------------------------------------------------------------------------------
def test_no_response_names_a_path_or_the_host(url: str) -> None:
    import platform

    bodies = [raw(url, "GET", p)[2] for p in ("/v1/models", "/v1/melix/receipt", "/openapi.json")]
    bodies.append(raw(url, "POST", "/v1/completions", json.dumps(completion()).encode())[2])
    bodies.append(raw(url, "POST", "/v1/completions", json.dumps(completion(model="/etc/x")).encode())[2])
    for body in bodies:
        text = body.decode()
        assert str(CKPT.parent) not in text and platform.node() not in text and platform.release() not in text
    answer = json.loads(bodies[3])
    assert answer["model"] == "stdlib-tiny" and answer["system_fingerprint"].startswith("melix-fsm-")


# -- auth and origins --------------------------------------------------------------------------
def test_api_key_is_required_everywhere_but_health(secured: str) -> None:
    assert healthy(secured)
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/melix/receipt"),
                         ("GET", "/openapi.json"), ("POST", "/v1/completions")):
        body = json.dumps(completion()).encode() if method == "POST" else None
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, got, payload = raw(secured, method, path, body, headers=headers)
            assert status == 401 and got["www-authenticate"] == "Bearer", (path, headers)
            assert json.loads(payload)["error"]["type"] == "authentication_error"
        assert raw(secured, method, path, body, headers=AUTH)[0] == 200, path
    with pytest.raises(openai.AuthenticationError):
        client(secured).models.list()
    answer = client(secured, KEY).completions.create(model="stdlib-tiny", **completion())
    assert answer.usage.completion_tokens == 4


def test_cors_only_for_allowed_origins(url: str, secured: str) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _ = raw(secured, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = raw(secured, "OPTIONS", "/v1/completions", headers={**preflight, "Origin": "http://evil"})
    assert status == 400 and "access-control-allow-origin" not in headers
    _, headers, _ = raw(secured, "GET", "/v1/models", headers={**AUTH, "Origin": "http://evil"})
    assert "access-control-allow-origin" not in headers
    _, headers, _ = raw(secured, "GET", "/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert headers["access-control-allow-origin"] == ORIGIN
    _, headers, _ = raw(url, "GET", "/v1/models", headers={"Origin": ORIGIN})  # none configured: no CORS
    assert not any(k.startswith("access-control-") for k in headers)


# -- limits of load -------------------------------------------------------------------------------
def test_a_full_queue_is_429_with_retry_after(served: Any) -> None:
    from melix_mlx.serve.limits import ServeLimits

    with serving(served, max_batch_size=1, limits=ServeLimits(max_queue=1)) as running:
        streams = [client(running.url).completions.create(
            model="stdlib-tiny", prompt=f"Once upon a time {i}", max_tokens=4000, stream=True)
            for i in range(2)]
        try:  # both were accepted (their 200 headers came): the row and the queue's one place
            assert metric(running.url, "melix_requests_in_flight") == 2
            status, headers, payload = post_json(running.url, "/v1/completions", completion())
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert payload["error"]["type"] == "rate_limit_error"
        finally:
            for stream in streams:
                stream.close()
        assert wait_until(lambda: metric(running.url, "melix_requests_in_flight") == 0, timeout=30)
        assert post_json(running.url, "/v1/completions", completion())[0] == 200
        assert metric(running.url, "melix_requests_total{state=cancelled}") == 2


def test_requests_are_counted_by_final_state(url: str) -> None:
    before = metric(url, "melix_requests_total{state=finished}")
    done = threading.Event()

    def run() -> None:
        client(url).completions.create(model="stdlib-tiny", **completion())
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert done.is_set()
    assert metric(url, "melix_requests_total{state=finished}") == before + 1


def test_a_seeded_request_whose_prompt_is_fully_cached_is_answered(url: str) -> None:
    """Found by the fuzz: mlx-lm's plain path failed on a prompt its cache held entirely."""
    request = completion(prompt="0", seed=0)
    first = client(url).completions.create(model="stdlib-tiny", **request)
    again = client(url).completions.create(model="stdlib-tiny", **request)
    assert again.choices[0].text == first.choices[0].text and again.usage.completion_tokens == 4


def test_slow_heads_and_bodies_are_cut_off(served: Any) -> None:
    """slowloris: a head or a body that drips in is refused at its deadline (1 s here)."""
    import socket

    from melix_mlx.serve.limits import ServeLimits
    from serve_helpers import host_port

    limits = ServeLimits(head_timeout_s=1.0, body_timeout_s=1.0)
    with serving(served, max_batch_size=1, limits=limits) as running:
        host, port = host_port(running.url)
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            began = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server
            assert 0.5 < time.monotonic() - began < 8
        with socket.create_connection((host, port), timeout=10) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: 100\r\n\r\n{")  # the body never ends
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert healthy(running.url)


def test_a_model_is_retrieved_by_its_served_name_only(url: str) -> None:
    assert client(url).models.retrieve("stdlib-tiny").id == "stdlib-tiny"
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve(str(CKPT))


def test_fault_messages_lose_their_paths() -> None:
    from melix_mlx.serve.privacy import redact

    text = redact("OSError: cannot open /home/someone/models/x/model.safetensors (see /etc/hosts)")
    assert text == "OSError: cannot open model.safetensors (see hosts)"
    assert redact("http://host/a/b and ./rel/x") == "http://host/a/b and ./rel/x"


def test_the_connection_cap_answers_503_in_the_one_shape(served: Any) -> None:
    import socket

    from melix_mlx.serve.limits import ServeLimits
    from serve_helpers import host_port

    with serving(served, max_batch_size=1, limits=ServeLimits(limit_concurrency=2)) as running:
        host, port = host_port(running.url)
        idle = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        try:
            time.sleep(0.2)  # the server has taken both connections
            status, headers, payload = raw(running.url, "GET", "/v1/models")
            assert status == 503 and headers["retry-after"] == "1"
            assert json.loads(payload)["error"]["code"] == "over_capacity"
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: raw(running.url, "GET", "/v1/models")[0] == 200, timeout=20)


def test_malformed_http_gets_a_400_in_the_one_shape(url: str) -> None:
    import socket

    from serve_helpers import host_port

    endless_head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000  # past h11's 16 KiB, unended
    for request in (b"GARBAGE\r\n\r\n", endless_head):
        with socket.create_connection(host_port(url), timeout=10) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), head[:80]
        assert_error_shape(json.loads(body))
    assert healthy(url)


def test_infinite_logprobs_are_null_not_a_500(served: Any) -> None:
    """Found by the deep fuzz: a masked token's logprob is -inf, which JSON cannot carry."""
    from melix_mlx.serve.limits import ServeLimits

    with serving(served, max_batch_size=1, limits=ServeLimits(max_logit_bias=1024)) as running:
        bias = {str(i): -1e300 for i in range(1024) if i != 7}  # -inf in float32: one token left
        for stream in (False, True):
            body = completion(logprobs=True, top_logprobs=3, logit_bias=bias, stream=stream)
            status, _, payload = raw(running.url, "POST", "/v1/completions", json.dumps(body).encode())
            assert status == 200, payload[:300]
            assert b"Infinity" not in payload and b"NaN" not in payload
        top = json.loads(raw(running.url, "POST", "/v1/completions", json.dumps(
            completion(logprobs=True, top_logprobs=3, logit_bias=bias)).encode())[2])
        entries = top["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        assert entries[0]["id"] == 7 and [e["logprob"] for e in entries[1:]] == [None, None]
