"""The Anthropic Messages API's request body, checked and turned into the server's request.

Rules of this module:
- The wire types are msgspec structs decoded from the JSON body (`msgspec.convert`):
  a field of the wrong type, a missing required field (`model`, `messages`,
  `max_tokens`) or a content block this server cannot take (documents, server tools) is
  a 400 naming where it is; unknown fields are ignored, as Anthropic's API ignores what
  it does not use (`metadata`, `cache_control`).
- A user's `image` blocks (a base64 `source` with its media type, or a `url` source)
  become the OpenAI route's `image_url` parts, in place among its text, so one check
  serves both APIs (melix_mlx.serve.images): a `--vision` server reads them, a text-only
  one answers 400 `images_unsupported`, and the same byte, pixel and count bounds and the
  same remote-url rule apply.
- A request becomes the same `Parsed` the OpenAI chat route builds
  (melix_mlx.serve.protocol), so it runs in the same batch through the same chat
  template: `system` (a string or text blocks) is a system message; text blocks are
  joined; an assistant's `tool_use` blocks are its `tool_calls` (arguments as objects,
  as chat templates take them) and its `thinking` blocks its `reasoning_content`; a
  user's `tool_result` blocks are `tool` messages, placed before the user's own text.
  `tools` become OpenAI function tools (`input_schema` is the parameters).
- `tool_choice`: `auto` renders the tools; `none` renders none; `any` and `tool` would
  need decoding constrained to a call, which this server does not do: refused (400),
  never served as if honoured. `thinking` sets the template's `enable_thinking`.
- The server's own limits apply as on the OpenAI routes (max_tokens, stop sequences,
  messages, top_k below the vocabulary).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .errors import ApiError
from .limits import ServeLimits
from .protocol import DEFAULT_MODEL, Defaults, Parsed, ServedRequest, check_model, generation_arguments

OBJECT = dict[str, Any]


class TextBlock(Struct, tag="text", tag_field="type"):
    text: str


class Base64Source(Struct, tag="base64", tag_field="type"):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(Struct, tag="url", tag_field="type"):
    url: str


class ImageBlock(Struct, tag="image", tag_field="type"):
    source: Base64Source | UrlSource


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: OBJECT


class ToolResultBlock(Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type"):
    data: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Struct):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    input_schema: OBJECT
    description: str = ""
    type: Literal["custom"] | None = None


class ToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Struct):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


NonNegative = Annotated[float, Meta(ge=0)]
Unit = Annotated[float, Meta(ge=0, le=1)]


class CountTokensRequest(Struct):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: NonNegative | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: OBJECT | None = None


def decode(body: Any, kind: type[Struct]) -> Any:
    """`body` (JSON data) as `kind`; a mismatch is a 400 naming where it is."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        out = msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc), param=_where(str(exc))) from None
    return out


def _where(message: str) -> str | None:
    """The field a msgspec message names (`... - at `$.messages[0].role``), top-level name only."""
    _, _, at = message.rpartition("at `$.")
    name = at.split("`")[0].split("[")[0].split(".")[0]
    return name or None


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(b.text for b in blocks)


def image_part(block: ImageBlock) -> dict[str, Any]:
    """An image block as the OpenAI route's `image_url` part (a base64 source as a data: URI)."""
    source = block.source
    url = source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's text joined as one string; with images (a user's), the parts in order
    (text runs joined)."""
    if not any(p["type"] == "image_url" for p in parts):
        return "".join(p["text"] for p in parts)
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"]}
        else:
            out.append(part)
    return out


def chat_messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (see the module rules)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        reasoning, calls, parts = [], [], []  # parts: text, and a user's images, in order
        for block in m.content:
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock) and m.role == "user":
                parts.append(image_part(block))
            elif isinstance(block, ThinkingBlock) and m.role == "assistant":
                reasoning.append(block.thinking)
            elif isinstance(block, RedactedThinkingBlock) and m.role == "assistant":
                continue  # nothing readable to render
            elif isinstance(block, ToolUseBlock) and m.role == "assistant":
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input},
                    }
                )
            elif isinstance(block, ToolResultBlock) and m.role == "user":
                out.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)}
                )
            else:
                kind = type(block).__name__.removesuffix("Block")
                raise ApiError(400, f"a {m.role} message cannot hold a {kind} block", param="messages")
        if m.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": _content(parts)}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        elif parts or not any(isinstance(b, ToolResultBlock) for b in m.content):
            out.append({"role": "user", "content": _content(parts)})
    return out


def chat_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict[str, Any]] | None:
    """`tools` as OpenAI function tools, as `tool_choice` allows (see the module rules)."""
    if choice is not None and choice.type in ("any", "tool"):
        raise ApiError(
            400,
            f"tool_choice {choice.type!r} is not supported: this server does not constrain "
            "decoding to a tool call (use 'auto' or 'none')",
            param="tool_choice",
        )
    if not tools or (choice is not None and choice.type == "none"):
        return None
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
        }
        for t in tools
    ]


def template_kwargs(thinking: Thinking | None) -> dict[str, Any] | None:
    if thinking is None:
        return None
    return {"enable_thinking": thinking.type != "disabled"}


def served_request(req: CountTokensRequest, limits: ServeLimits) -> ServedRequest:
    if len(req.messages) > limits.max_messages:
        raise ApiError(400, f"messages may hold at most {limits.max_messages} entries", param="messages")
    messages = chat_messages(req.system, req.messages)
    tools = chat_tools(req.tools, req.tool_choice)
    return ServedRequest("chat", "", messages, tools, None, limits.max_prompt_tokens or 0)


def parse_messages(
    body: Any, *, limits: ServeLimits, vocab: int, names: list[str], defaults: Defaults
) -> tuple[Parsed, MessagesRequest]:
    """The checked Messages request as the server's `Parsed` (see the module rules)."""
    req: MessagesRequest = decode(body, MessagesRequest)
    shown = check_model(req.model, names)
    fields = {
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "chat_template_kwargs": template_kwargs(req.thinking),
    }
    args = generation_arguments(
        {k: v for k, v in fields.items() if v is not None},
        limits=limits,
        vocab=vocab,
        defaults=defaults,
        stop_param="stop_sequences",
    )
    request = served_request(req, limits)
    kind = "chat.completion.chunk" if req.stream else "chat.completion"  # the Assembler builds chat shapes
    parsed = Parsed(request, args, req.stream, True, shown, f"msg_{uuid.uuid4().hex[:24]}", kind)
    return parsed, req


def parse_count(body: Any, *, limits: ServeLimits, names: list[str]) -> tuple[ServedRequest, Any]:
    """A count_tokens body: the request to tokenize and its template arguments."""
    req: CountTokensRequest = decode(body, CountTokensRequest)
    check_model(req.model, names)
    return served_request(req, limits), template_kwargs(req.thinking)


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments (a JSON string) as the `tool_use` block's input object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


__all__ = ["DEFAULT_MODEL", "MessagesRequest", "CountTokensRequest", "parse_messages", "parse_count"]
