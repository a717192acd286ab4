"""Tool calls and reasoning on both APIs, with and without MTP: the plumbing, not the model's skill.

The served tokenizer is the embedded checkpoint's, carrying a chat template in Qwen's
format (tools in `<tools>`, calls as `<tool_call>{json}</tool_call>`, results in
`<tool_response>`, reasoning in `<think>...</think>`; mlx-lm infers its JSON tool parser
from the template) and Qwen's think markers (as multi-token markers: the tiny vocabulary
has no single token for them). The model's text is forced: a logits processor added to
every request (a generator subclass, as the server's own substitution hook allows) pins
each position to a scripted token, so the parsers see exactly the scripted text, whether
the row speculates (k = 2, forced on) or not (method none). Real servers on loopback
ports; the `openai` and `anthropic` clients; every wait bounded.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import TIMEOUT_S, client, serving  # noqa: E402  (tests/adapters is on sys.path)

CKPT = EMBEDDED["stdlib-tiny"]
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")

# Qwen's chat format (system, tools, tool calls, tool responses, reasoning), written for this test
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

SCRIPT = (  # the model's forced text: reasoning, a sentence, one call
    '<think>\nFind x.\n</think>\n\nOk.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "n": 2}}\n'
    "</tool_call>"
)
TOOL = {
    "name": "lookup",
    "description": "Find a name.",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL["name"],
        "description": TOOL["description"],
        "parameters": TOOL["input_schema"],
    },
}
QUESTION = [{"role": "user", "content": "Where is x?"}]


def qwen_tokenizer(directory: Any) -> Any:
    from mlx_lm.tokenizer_utils import load

    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(CKPT / name, directory / name)
    config = json.loads((CKPT / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    tokenizer = load(directory)
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    # Qwen's think markers, as mlx-lm's multi-token thinking mode holds them
    encode = tokenizer._tokenizer.encode
    tokenizer._think_start, tokenizer._think_end = "<think>", "</think>"
    tokenizer._think_start_tokens = tuple(encode("<think>", add_special_tokens=False))
    tokenizer._think_end_tokens = tuple(encode("</think>", add_special_tokens=False))
    return tokenizer


class Forced:
    """A logits processor that pins each generated position to the script, then to EOS."""

    def __init__(self, script: list[int], eos: int) -> None:
        self.script = script
        self.eos = eos
        self.prompt: int | None = None  # the history's length at the first position

    def __call__(self, history: Any, logits: Any) -> Any:
        import mlx.core as mx

        if self.prompt is None:
            self.prompt = history.size
        i = history.size - self.prompt
        token = self.script[i] if i < len(self.script) else self.eos
        return (
            mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -mx.inf).astype(logits.dtype)[None]
            + 0 * logits
        )


def scripted_generator(script: list[int], eos: int) -> type:
    from melix_mlx.serve.runtime import ServingResponseGenerator

    class Scripted(ServingResponseGenerator):
        def substitutions(self) -> dict[str, Any]:
            own = super().substitutions()
            served = own["_make_logits_processors"]  # the server's own processors, then the script
            return {**own, "_make_logits_processors": lambda args: [*served(args), Forced(script, eos)]}

    return Scripted


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: Any) -> Any:
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen-format"))


@pytest.fixture(scope="module", params=["mtp", "none"])
def url(request: Any, tokenizer: Any) -> Any:
    from melix_mlx.serve.provider import load_served_model

    if request.param == "mtp":
        served = load_served_model(None, 2, "force_on")
    else:
        served = load_served_model(None, method="none")
    served = replace(served, tokenizer=tokenizer)
    script = tokenizer.encode(SCRIPT, add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)
    with serving(served, max_batch_size=2, generator_class=scripted_generator(script, eos)) as running:
        running.method = request.param
        yield running.url, request.param


def openai_chat(url: str, stream: bool = False, **fields: Any) -> Any:
    request = {
        "model": "stdlib-tiny",
        "messages": QUESTION,
        "tools": [OPENAI_TOOL],
        "max_tokens": 200,
        "temperature": 0,
        **fields,
    }
    return client(url).chat.completions.create(stream=stream, **request)


def messages_client(url: str) -> Any:
    return anthropic.Anthropic(base_url=url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def assert_the_scripted_call(name: str, arguments: dict[str, Any]) -> None:
    assert name == "lookup" and arguments == {"q": "x", "n": 2}


def test_openai_whole_and_stream_separate_reasoning_text_and_the_call(url: Any) -> None:
    address, method = url
    answer = openai_chat(address)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"].strip() == "Find x."
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    assert message.content.strip() == "Ok."
    (call,) = message.tool_calls
    assert_the_scripted_call(call.function.name, json.loads(call.function.arguments))
    assert answer.usage.model_extra["speculative"]["method"] == method
    reasoning = content = ""
    calls = []
    finish = None
    for chunk in openai_chat(address, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == message.model_extra["reasoning_content"] and content == message.content
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].index == 0
    assert_the_scripted_call(calls[0].function.name, json.loads(calls[0].function.arguments))


def test_anthropic_whole_and_stream_make_thinking_text_and_tool_use_blocks(url: Any) -> None:
    address, method = url
    request = {
        "model": "stdlib-tiny",
        "max_tokens": 200,
        "messages": QUESTION,
        "tools": [TOOL],
        "extra_body": {"temperature": 0},
    }
    message = messages_client(address).messages.create(**request)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking.strip() == "Find x."
    assert message.content[1].text.strip() == "Ok."
    call = message.content[2]
    assert call.id.startswith("toolu_")
    assert_the_scripted_call(call.name, call.input)
    assert message.stop_reason == "tool_use"
    assert message.usage.model_extra["speculative"]["method"] == method
    with messages_client(address).messages.stream(**request) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[0].thinking == message.content[0].thinking
    assert streamed.content[1].text == message.content[1].text
    assert_the_scripted_call(streamed.content[2].name, streamed.content[2].input)
    assert streamed.stop_reason == "tool_use"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3


def test_tool_results_round_trip_through_the_template(url: Any, tokenizer: Any) -> None:
    """The call and its result come back as the template renders them, on both APIs."""
    address, method = url
    if method != "mtp":
        pytest.skip("the prompt does not depend on the method: one server renders it")
    openai_turns = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": "x", "n": 2})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x is in the shed"},
    ]
    anthropic_turns = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x", "n": 2}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "x is in the shed"}],
                }
            ],
        },
    ]
    rendered = tokenizer.apply_chat_template(
        [
            *openai_turns[:1],
            {
                **openai_turns[1],
                "tool_calls": [{"function": {"name": "lookup", "arguments": {"q": "x", "n": 2}}}],
            },
            openai_turns[2],
        ],
        tools=[OPENAI_TOOL],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "n": 2}}\n</tool_call>' in rendered
    assert "<tool_response>\nx is in the shed\n</tool_response>" in rendered
    expected = len(tokenizer.encode(rendered, add_special_tokens=False))
    answer = openai_chat(address, messages=openai_turns, max_tokens=1)
    counted = messages_client(address).messages.count_tokens(
        model="stdlib-tiny", messages=anthropic_turns, tools=[TOOL]
    )
    message = messages_client(address).messages.create(
        model="stdlib-tiny",
        max_tokens=1,
        messages=anthropic_turns,
        tools=[TOOL],
        extra_body={"temperature": 0},
    )
    assert answer.usage.prompt_tokens == counted.input_tokens == expected
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected


def test_tool_choice_none_renders_no_tools(url: Any) -> None:
    address, _ = url
    counted = messages_client(address).messages.count_tokens
    with_tools = counted(model="stdlib-tiny", messages=QUESTION, tools=[TOOL]).input_tokens
    without = counted(model="stdlib-tiny", messages=QUESTION, tools=[TOOL], tool_choice={"type": "none"})
    assert without.input_tokens == counted(model="stdlib-tiny", messages=QUESTION).input_tokens < with_tools
