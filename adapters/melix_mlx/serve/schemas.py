"""The OpenAPI description of the two POST bodies, with this server's limits in it.

Rules: the routes read their bodies themselves (melix_mlx.serve.protocol checks them
with mlx-lm's rules), so the schema is declared here, not derived from models; it
states the same bounds the checks enforce (max_tokens, logit_bias size, stop list, n),
so a client or a fuzzer generating from it sends what the server means to accept.
"""

from __future__ import annotations

from typing import Any

from .limits import ServeLimits


def _common(limits: ServeLimits, vocab: int) -> dict[str, Any]:
    number = {"type": "number"}
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens_limit},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens_limit},
        "temperature": {**number, "minimum": 0},
        "top_p": {**number, "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
        "min_p": {**number, "minimum": 0, "maximum": 1},
        "n": {"type": "integer", "enum": [1]},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {
            "oneOf": [
                {"type": "string", "maxLength": limits.max_stop_chars},
                {
                    "type": "array",
                    "maxItems": limits.max_stop,
                    "items": {"type": "string", "maxLength": limits.max_stop_chars},
                },
            ]
        },
        "logit_bias": {
            "type": "object",
            "maxProperties": limits.max_logit_bias,
            "additionalProperties": {"type": "number"},
            "description": "token id (a decimal string inside the vocabulary) to bias",
        },
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 11},
        "seed": {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1},
        "repetition_penalty": {**number, "minimum": 0},
        "presence_penalty": number,
        "frequency_penalty": number,
        "xtc_probability": {**number, "minimum": 0, "maximum": 1},
        "xtc_threshold": {**number, "minimum": 0, "maximum": 0.5},
    }


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def completion_body(limits: ServeLimits, vocab: int) -> dict[str, Any]:
    properties = {"prompt": {"type": "string", "minLength": 1}, **_common(limits, vocab)}
    return _body({"type": "object", "required": ["prompt"], "properties": properties})


def chat_body(limits: ServeLimits, vocab: int) -> dict[str, Any]:
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "oneOf": [
                                {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
                                },
                                {
                                    "type": "object",
                                    "required": ["type", "image_url"],  # a --vision server's
                                    "properties": {
                                        "type": {"enum": ["image_url"]},
                                        "image_url": {
                                            "type": "object",
                                            "required": ["url"],
                                            "properties": {"url": {"type": "string"}},
                                        },
                                    },
                                },
                            ]
                        },
                    },
                ]
            },
        },
    }
    properties = {
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": message},
        **_common(limits, vocab),
    }
    return _body({"type": "object", "required": ["messages"], "properties": properties})


# an Anthropic image block: a --vision server's (melix_mlx.serve.anthropic_wire)
ANTHROPIC_IMAGE = {
    "type": "object",
    "required": ["type", "source"],
    "properties": {
        "type": {"enum": ["image"]},
        "source": {
            "oneOf": [
                {
                    "type": "object",
                    "required": ["type", "media_type", "data"],
                    "properties": {
                        "type": {"enum": ["base64"]},
                        "media_type": {"enum": ["image/jpeg", "image/png", "image/gif", "image/webp"]},
                        "data": {"type": "string"},
                    },
                },
                {
                    "type": "object",
                    "required": ["type", "url"],
                    "properties": {"type": {"enum": ["url"]}, "url": {"type": "string"}},
                },
            ]
        },
    },
}


def _anthropic_conversation(limits: ServeLimits) -> dict[str, Any]:
    text = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
    }
    texts = {"type": "array", "items": text}
    tool_use = {
        "type": "object",
        "required": ["type", "id", "name", "input"],
        "properties": {
            "type": {"enum": ["tool_use"]},
            "id": {"type": "string"},
            "name": {"type": "string"},
            "input": {"type": "object"},
        },
    }
    tool_result = {
        "type": "object",
        "required": ["type", "tool_use_id"],
        "properties": {
            "type": {"enum": ["tool_result"]},
            "tool_use_id": {"type": "string"},
            "content": {"oneOf": [{"type": "string"}, texts]},
            "is_error": {"type": "boolean"},
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"oneOf": [text, ANTHROPIC_IMAGE, tool_use, tool_result]}},
                ]
            },
        },
    }
    tool = {
        "type": "object",
        "required": ["name", "input_schema"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 128},
            "description": {"type": "string"},
            "input_schema": {"type": "object"},
        },
    }
    return {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": message},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": text}]},
        "tools": {"type": "array", "items": tool},
        "tool_choice": {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["auto", "none"]}, "name": {"type": "string"}},
        },
        "thinking": {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer"}},
        },
    }


def messages_body(limits: ServeLimits, vocab: int) -> dict[str, Any]:
    """The Anthropic Messages API's body (melix_mlx.serve.anthropic_wire)."""
    properties = {
        **_anthropic_conversation(limits),
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens_limit},
        "stop_sequences": {
            "type": "array",
            "maxItems": limits.max_stop,
            "items": {"type": "string", "maxLength": limits.max_stop_chars},
        },
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
        "metadata": {"type": "object"},
    }
    required = ["model", "messages", "max_tokens"]
    return _body({"type": "object", "required": required, "properties": properties})


def count_tokens_body(limits: ServeLimits) -> dict[str, Any]:
    properties = _anthropic_conversation(limits)
    return _body({"type": "object", "required": ["model", "messages"], "properties": properties})
