"""A request body, checked and turned into mlx-lm's generation arguments.

Rules of this module:
- Field names, defaults and type rules are mlx-lm's server's (`APIHandler.do_POST` and
  `validate_model_parameters`, 0.32), so a valid request means what it means there.
- Stricter, and all before the generation thread sees anything (no array is built from an
  unchecked field): `logit_bias` keys are integers inside the vocabulary and at most
  `max_logit_bias` of them, values finite; `max_tokens` within the server's limit; `n`
  only 1; stop sequences strings, at most `max_stop`; an empty prompt or no messages is
  refused; a message's content is a string, or text parts and image parts (checked
  against the served model by melix_mlx.serve.images; mlx-lm's loop dies of other parts:
  it reads them outside its guard); `model` names the served model (or mlx-lm's
  "default_model"); client-chosen adapters and draft models are refused. Every refusal
  is an `ApiError` naming the field.
- A sampled request with a seed draws in a logits processor (melix_mlx.serve.seeded): it
  cannot also ask for logprobs or XTC (400).
- The prompt-token limit needs the tokenized prompt: the generation thread checks it
  (melix_mlx.serve.runtime) before any prefill.
"""

from __future__ import annotations

import math
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.server import (
    CompletionRequest,
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
)

from .errors import ApiError
from .limits import ServeLimits
from .seeded import seeded

DEFAULT_MODEL = "default_model"  # mlx-lm's name for the server's own model


@dataclass
class ServedRequest(CompletionRequest):
    """mlx-lm's request plus what the generation thread checks before prefilling it."""

    max_prompt_tokens: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokenized: tuple | None = None  # mlx-lm's `_tokenize` result, made on the HTTP side


@dataclass(frozen=True)
class Defaults:
    """What the server fills in for absent fields (mlx-lm's CLI defaults)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    num_draft_tokens: int = 1


@dataclass
class Parsed:
    request: ServedRequest
    args: GenerationArguments
    stream: bool
    include_usage: bool
    model: str  # the name echoed back: the served name
    request_id: str
    object_type: str


def _typed(body: dict, name: str, types: Any, default: Any, lo: Any = None, hi: Any = None) -> Any:
    value = body.get(name, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"{name} must be of type {_names(types)}", param=name)
    if not isinstance(value, types):
        raise ApiError(400, f"{name} must be of type {_names(types)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name} must be finite", param=name)
    if lo is not None and value < lo:
        raise ApiError(400, f"{name} must be at least {lo}", param=name)
    if hi is not None and value > hi:
        raise ApiError(400, f"{name} must be at most {hi}", param=name)
    return value


def _names(types: Any) -> str:
    return "/".join(t.__name__ for t in types) if isinstance(types, tuple) else types.__name__


def logit_bias(value: Any, vocab: int, limit: int) -> dict[int, float] | None:
    """`logit_bias` as {token id: bias}: ids inside [0, vocab), at most `limit` of them."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias must be an object of token id to number", param="logit_bias")
    if len(value) > limit:
        raise ApiError(400, f"logit_bias may name at most {limit} tokens", param="logit_bias")
    out = {}
    for key, bias in value.items():
        text = str(key).strip()
        if not (text.isdigit() or (text.startswith("-") and text[1:].isdigit())) or len(text) > 12:
            raise ApiError(400, f"logit_bias key {str(key)[:20]!r} is not a token id", param="logit_bias")
        token = int(text)
        if not 0 <= token < vocab:
            raise ApiError(
                400, f"logit_bias token {token} is outside the vocabulary [0, {vocab})", param="logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise ApiError(400, "logit_bias values must be finite numbers", param="logit_bias")
        out[token] = float(bias)
    return out


def stop_words(value: Any, limits: ServeLimits, param: str = "stop") -> list[str]:
    words = [value] if isinstance(value, str) else (value or [])
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ApiError(400, f"{param} must be a string or a list of strings", param=param)
    if len(words) > limits.max_stop:
        raise ApiError(400, f"{param} may hold at most {limits.max_stop} sequences", param=param)
    if any(len(w) > limits.max_stop_chars for w in words):
        limit = limits.max_stop_chars
        raise ApiError(400, f"a stop sequence may be at most {limit} characters", param=param)
    return [w for w in words if w]


def completion_request(body: dict, chat: bool, limits: ServeLimits) -> ServedRequest:
    if not chat:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return ServedRequest("text", prompt, [], None, None, limits.max_prompt_tokens or 0)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    if len(messages) > limits.max_messages:
        raise ApiError(400, f"messages may hold at most {limits.max_messages} entries", param="messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ApiError(400, "each message must be an object with a string role", param="messages")
        _content(m.get("content"))
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "tools must be a list of objects", param="tools")
    mapping = body.get("role_mapping")
    if mapping is not None and not isinstance(mapping, dict):
        raise ApiError(400, "role_mapping must be an object", param="role_mapping")
    return ServedRequest("chat", "", messages, tools or None, mapping, limits.max_prompt_tokens or 0)


def _content(content: Any) -> None:
    """A message's content: a string, or text and image parts."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(400, "a message's content must be a string or a list of parts", param="messages")
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image_url":
            continue  # checked against the served model's image bounds (melix_mlx.serve.images)
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400, 'content parts must be text parts ({"type": "text", "text": ...})', param="messages"
            )


def check_model(model: Any, names: list[str]) -> str:
    """The name to echo back for a request's `model` (the served name); 400/404 otherwise."""
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    if model != DEFAULT_MODEL and model not in names:
        raise ApiError(
            404,
            f"model {model[:100]!r} is not served here (serving {names[0]})",
            param="model",
            code="model_not_found",
        )
    return names[0] if model == DEFAULT_MODEL else model


def generation_arguments(
    body: dict, *, limits: ServeLimits, vocab: int, defaults: Defaults, stop_param: str = "stop"
) -> GenerationArguments:
    """mlx-lm's generation arguments from the body's sampling fields, checked (see the rules)."""
    max_tokens = body.get("max_completion_tokens")
    key = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    max_tokens = _typed(body, key, int, defaults.max_tokens, 1, limits.max_tokens_limit)
    sampling = SamplingArguments(
        temperature=_typed(body, "temperature", (float, int), defaults.temperature, 0),
        top_p=_typed(body, "top_p", (float, int), defaults.top_p, 0, 1),
        top_k=_typed(body, "top_k", int, defaults.top_k, 0, vocab - 1),  # mlx-lm's sampler: below vocab
        min_p=_typed(body, "min_p", (float, int), defaults.min_p, 0, 1),
        xtc_probability=_typed(body, "xtc_probability", (float, int), 0.0, 0, 1),
        xtc_threshold=_typed(body, "xtc_threshold", (float, int), 0.1, 0, 0.5),  # mlx-lm's apply_xtc
    )
    logits = LogitsProcessorArguments(
        logit_bias=logit_bias(body.get("logit_bias"), vocab, limits.max_logit_bias),
        repetition_penalty=_typed(body, "repetition_penalty", (float, int), 0.0, 0),
        repetition_context_size=_typed(body, "repetition_context_size", int, 20, 0, 1 << 16),
        presence_penalty=_typed(body, "presence_penalty", (float, int), 0.0),
        presence_context_size=_typed(body, "presence_context_size", int, 20, 0, 1 << 16),
        frequency_penalty=_typed(body, "frequency_penalty", (float, int), 0.0),
        frequency_context_size=_typed(body, "frequency_context_size", int, 20, 0, 1 << 16),
    )
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    args = GenerationArguments(
        model=ModelDescription(model=DEFAULT_MODEL, draft=DEFAULT_MODEL, adapter=None),
        sampling=sampling,
        logits=logits,
        stop_words=stop_words(body.get("stop"), limits, stop_param),
        max_tokens=max_tokens,
        num_draft_tokens=_draft_tokens(body, defaults.num_draft_tokens),
        logprobs=_typed(body, "logprobs", bool, False),
        top_logprobs=_top_logprobs(body),
        seed=_typed(body, "seed", int, None, 0, (1 << 32) - 1),
        chat_template_kwargs=template_kwargs,
    )
    if seeded(args):  # its row draws in a processor that leaves one token (melix_mlx.serve.seeded)
        if args.logprobs or args.top_logprobs > 0:
            raise ApiError(400, "a sampled request with a seed cannot report logprobs", param="seed")
        if args.sampling.xtc_probability > 0:
            raise ApiError(400, "a sampled request with a seed cannot use XTC", param="seed")
    return args


def parse(
    body: Any, chat: bool, *, limits: ServeLimits, vocab: int, names: list[str], defaults: Defaults
) -> Parsed:
    """The checked request (see the module rules); raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    shown = check_model(body.get("model", DEFAULT_MODEL), names)
    for name in ("adapters", "draft_model"):
        if body.get(name) not in (None, DEFAULT_MODEL):
            raise ApiError(400, f"{name} cannot be chosen by a request", param=name)
    n = _typed(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    args = generation_arguments(body, limits=limits, vocab=vocab, defaults=defaults)
    request = completion_request(body, chat, limits)
    prefix, kind = (
        ("chatcmpl", "chat.completion.chunk" if stream else "chat.completion")
        if chat
        else ("cmpl", "text_completion")
    )
    return Parsed(request, args, stream, include_usage, shown, f"{prefix}-{uuid.uuid4()}", kind)


def _top_logprobs(body: dict) -> int:
    value = _typed(body, "top_logprobs", int, -1, -1, 11)
    if value < 0 and value != -1:
        raise ApiError(400, "top_logprobs must be at least 0", param="top_logprobs")
    return value


def _draft_tokens(body: dict, served: int) -> int:
    """The server's depth: a request may repeat it, never change it (it would be ignored)."""
    value = _typed(body, "num_draft_tokens", int, served, 0)
    if value != served:
        raise ApiError(
            400,
            f"num_draft_tokens is the server's ({served}); set it with --num-draft-tokens",
            param="num_draft_tokens",
        )
    return value
