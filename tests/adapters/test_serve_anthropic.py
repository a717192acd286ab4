"""The Anthropic Messages API on the served batch, driven by the official `anthropic` client.

One real server (embedded stdlib-tiny, k = 2, policy forced on, an API key) on a loopback
port for the module. Greedy answers equal the OpenAI chat route's for the same
conversation; streams arrive in Anthropic's event order; a client that goes away frees
its row; every refusal has Anthropic's error shape and status. Every wait is bounded.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import (  # noqa: E402  (tests/adapters is on sys.path)
    TIMEOUT_S,
    client,
    healthy,
    metric,
    post_json,
    raw,
    serving,
    wait_until,
)

CKPT = EMBEDDED["stdlib-tiny"]
KEY = "anthropic-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0}  # the 2.x client takes sampling fields through extra_body
SYSTEM = "You write Python."
TURNS = [
    {"role": "user", "content": "def main():"},
    {"role": "assistant", "content": "    pass"},
    {"role": "user", "content": [{"type": "text", "text": "def parse("}, {"type": "text", "text": "text):"}]},
]
IMAGE_BLOCK = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def served() -> Any:
    from melix_mlx.serve.provider import load_served_model

    return load_served_model(None, 2, "force_on")


@pytest.fixture(scope="module")
def url(served: Any) -> Any:
    from melix_mlx.serve.limits import ServeLimits

    limits = ServeLimits(max_prompt_tokens=256, max_tokens_limit=512)
    with serving(served, max_batch_size=4, limits=limits, api_key=KEY) as running:
        yield running.url


def messages_client(url: str, key: str = KEY) -> Any:
    return anthropic.Anthropic(base_url=url, api_key=key, timeout=TIMEOUT_S, max_retries=0)


def create(url: str, **fields: Any) -> Any:
    request = {"model": "stdlib-tiny", "max_tokens": 16, "messages": TURNS, "system": SYSTEM, **fields}
    return messages_client(url).messages.create(**request, extra_body=GREEDY)


def openai_chat(url: str, messages: list[dict], **fields: Any) -> Any:
    request = {"model": "stdlib-tiny", "messages": messages, "max_tokens": 16, "temperature": 0, **fields}
    return client(url, KEY).chat.completions.create(**request)


def events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of a streamed Messages request, read raw."""
    status, headers, payload = raw(url, "POST", "/v1/messages", json.dumps(body).encode(), headers=AUTH)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), payload[:300]
    out = []
    for block in payload.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            data = json.loads(lines["data"])
            assert data["type"] == lines["event"]
            out.append((lines["event"], data))
    return out


def assert_anthropic_error(payload: Any, kind: str) -> None:
    assert set(payload) == {"type", "error"} and payload["type"] == "error", payload
    assert set(payload["error"]) == {"type", "message"} and payload["error"]["type"] == kind, payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


# -- identity with the OpenAI route ------------------------------------------------------------
def test_greedy_answer_equals_the_openai_chat_route(url: str) -> None:
    message = create(url)
    flat = [
        {"role": "system", "content": SYSTEM},
        *TURNS[:2],
        {"role": "user", "content": "def parse(text):"},
    ]
    openai_answer = openai_chat(url, flat)
    assert message.type == "message" and message.role == "assistant" and message.model == "stdlib-tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == openai_answer.choices[0].message.content
    assert message.usage.output_tokens == openai_answer.usage.completion_tokens == 16
    prompt = openai_answer.usage.prompt_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    speculative = message.usage.model_extra["speculative"]
    assert speculative["method"] == "mtp" and speculative["proposed"] > 0


def test_streamed_text_equals_the_whole_answer_in_event_order(url: str) -> None:
    body = {
        "model": "stdlib-tiny",
        "max_tokens": 16,
        "messages": TURNS,
        "system": SYSTEM,
        "stream": True,
        **GREEDY,
    }
    got = events(url, body)
    kinds = [k for k, _ in got]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    body_kinds = [k for k in kinds[2:-2] if k != "ping"]
    assert body_kinds[0] == "content_block_start" and body_kinds[-1] == "content_block_stop"
    assert set(body_kinds[1:-1]) == {"content_block_delta"}
    start = got[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    text = "".join(d["delta"]["text"] for k, d in got if k == "content_block_delta")
    assert text == create(url).content[0].text
    final = got[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 16 and final["usage"]["speculative"]["method"] == "mtp"
    with messages_client(url).messages.stream(
        model="stdlib-tiny", max_tokens=16, messages=TURNS, system=SYSTEM, extra_body=GREEDY
    ) as stream:
        assert stream.get_final_text() == text


def test_stop_sequences_end_the_turn_and_are_named(url: str, served: Any) -> None:
    whole = create(url).content[0].text
    tokens = served.tokenizer.encode(whole, add_special_tokens=False)
    # a later token of the greedy answer that encodes back to itself: mlx-lm matches stop
    # sequences as tokens
    word = next(
        w
        for t in tokens[3:]
        if (w := served.tokenizer.decode([t])).strip()
        and served.tokenizer.encode(w, add_special_tokens=False) == [t]
    )
    stopped = create(url, stop_sequences=[word, "never-seen"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and whole.startswith(stopped.content[0].text)
    short = create(url, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_tool_blocks_and_tools_render_as_the_openai_route_does(url: str) -> None:
    tool = {"name": "lookup", "description": "Find a name.", "input_schema": {"type": "object"}}
    turns = [
        {"role": "user", "content": "Find x."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"},
                {"type": "text", "text": "def main():"},
            ],
        },
    ]
    message = messages_client(url).messages.create(
        model="stdlib-tiny",
        max_tokens=8,
        messages=turns,
        tools=[tool],
        tool_choice={"type": "auto"},
        extra_body=GREEDY,
    )
    flat = [
        {"role": "user", "content": "Find x."},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "x = 1"},
        {"role": "user", "content": "def main():"},
    ]
    openai_tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Find a name.", "parameters": {"type": "object"}},
    }
    answer = openai_chat(url, flat, max_tokens=8, tools=[openai_tool])
    assert message.content[0].text == answer.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == answer.usage.prompt_tokens


def test_count_tokens_is_the_prompt_the_request_runs(url: str) -> None:
    counted = messages_client(url).messages.count_tokens(model="stdlib-tiny", messages=TURNS, system=SYSTEM)
    message = create(url, max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0


def test_image_blocks_become_image_parts_in_place() -> None:
    from melix_mlx.serve.anthropic_wire import MessagesRequest, chat_messages, decode

    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {
        "model": "m",
        "max_tokens": 1,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "text", "text": "b"},
                    IMAGE_BLOCK,
                    {"type": "text", "text": "c"},
                    url_image,
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "no image"}]},
        ],
    }
    with_images, text_only = chat_messages(None, decode(body, MessagesRequest).messages)
    assert with_images["content"] == [
        {"type": "text", "text": "ab"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + IMAGE_BLOCK["source"]["data"]}},
        {"type": "text", "text": "c"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    assert text_only == {"role": "user", "content": "no image"}


def test_an_image_to_this_text_only_server_is_refused_by_name(url: str) -> None:
    body = {"model": "stdlib-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [IMAGE_BLOCK]}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _, payload = post_json(url, path, body, headers=AUTH)
        assert status == 400, payload
        assert_anthropic_error(payload, "invalid_request_error")
        assert "takes no images" in payload["error"]["message"], payload
    assert healthy(url)


# -- cancellation --------------------------------------------------------------------------------
def test_a_client_that_goes_away_frees_its_row(url: str) -> None:
    before = metric(url, "melix_requests_total{state=cancelled}", headers=AUTH)
    with messages_client(url).messages.stream(
        model="stdlib-tiny",
        max_tokens=500,
        messages=[{"role": "user", "content": "Once upon a time"}],
        extra_body=GREEDY,
    ) as stream:
        for item in stream:
            if item.type == "content_block_delta":
                break  # leave mid-generation: the connection closes
    assert wait_until(lambda: metric(url, "melix_requests_in_flight", headers=AUTH) == 0, timeout=30)
    assert metric(url, "melix_requests_total{state=cancelled}", headers=AUTH) == before + 1
    states = ("speculating", "suspended", "plain")
    rows = lambda: sum(metric(url, f"melix_batch_rows{{state={s}}}", headers=AUTH) for s in states)  # noqa: E731
    assert wait_until(lambda: rows() == 0, timeout=30)  # the generation thread removed the row
    assert create(url, max_tokens=2).usage.output_tokens == 2


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (b"{not json", 400, "invalid_request_error"),
        (b"[]", 400, "invalid_request_error"),
        (json.dumps({"model": "stdlib-tiny", "messages": TURNS}).encode(), 400, "invalid_request_error"),
        (
            json.dumps({"model": "stdlib-tiny", "messages": [], "max_tokens": 4}).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {
                    "model": "stdlib-tiny",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                }
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (  # a well-formed image to a text-only server (a --vision server reads it: test_vlm_serve)
            json.dumps(
                {
                    "model": "stdlib-tiny",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": [IMAGE_BLOCK, {"type": "text", "text": "a"}]}],
                }
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {
                    "model": "stdlib-tiny",
                    "max_tokens": 4,
                    "messages": [{"role": "assistant", "content": [IMAGE_BLOCK]}],
                }
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {
                    "model": "stdlib-tiny",
                    "max_tokens": 4,
                    "messages": [
                        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}
                    ],
                }
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {
                    "model": "stdlib-tiny",
                    "max_tokens": 4,
                    "messages": TURNS,
                    "tools": [{"name": "f", "input_schema": {}}],
                    "tool_choice": {"type": "any"},
                }
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps({"model": "stdlib-tiny", "max_tokens": 100000, "messages": TURNS}).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(
                {"model": "stdlib-tiny", "max_tokens": 4, "messages": TURNS, "temperature": -1}
            ).encode(),
            400,
            "invalid_request_error",
        ),
        (json.dumps({"model": "other", "max_tokens": 4, "messages": TURNS}).encode(), 404, "not_found_error"),
    ],
)
def test_bad_requests_get_anthropic_errors(url: str, body: bytes, status: int, kind: str) -> None:
    got, _, payload = raw(url, "POST", "/v1/messages", body, headers=AUTH)
    assert got == status, payload
    assert_anthropic_error(json.loads(payload), kind)
    assert healthy(url)


def test_the_client_raises_typed_errors(url: str) -> None:
    with pytest.raises(anthropic.BadRequestError, match="at most 256"):
        create(url, messages=[{"role": "user", "content": "the king " * 200}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        messages_client(url).messages.create(model="stdlib-tiny", max_tokens=0, messages=TURNS)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        messages_client(url, "wrong").messages.create(model="stdlib-tiny", max_tokens=2, messages=TURNS)
    assert_anthropic_error(caught.value.body, "authentication_error")
    with pytest.raises(anthropic.NotFoundError):
        messages_client(url).messages.create(model="gpt-4", max_tokens=2, messages=TURNS)


def test_x_api_key_is_accepted_beside_bearer(url: str) -> None:
    body = {"model": "stdlib-tiny", "max_tokens": 2, "messages": TURNS}
    for headers in ({"x-api-key": KEY}, AUTH):
        status, _, payload = post_json(url, "/v1/messages", body, headers=headers)
        assert status == 200 and payload["usage"]["output_tokens"] == 2, payload
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        status, _, payload = post_json(url, "/v1/messages", body, headers=headers)
        assert status == 401
        assert_anthropic_error(payload, "authentication_error")
    status, _, payload = post_json(url, "/v1/completions", {"prompt": "x"}, headers={"x-api-key": "wrong"})
    assert status == 401 and set(payload["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
    status, _, payload = raw(
        url, "POST", "/v1/messages", b"{}", headers={**AUTH, "Content-Type": "text/plain"}
    )
    assert status == 415
    assert_anthropic_error(json.loads(payload), "invalid_request_error")
