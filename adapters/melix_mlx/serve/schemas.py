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
                {"type": "array", "maxItems": limits.max_stop,
                 "items": {"type": "string", "maxLength": limits.max_stop_chars}},
            ]
        },
        "logit_bias": {
            "type": "object", "maxProperties": limits.max_logit_bias,
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
                    {"type": "array", "items": {
                        "type": "object", "required": ["type", "text"],
                        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
                    }},
                ]
            },
        },
    }
    properties = {
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": message},
        **_common(limits, vocab),
    }
    return _body({"type": "object", "required": ["messages"], "properties": properties})
