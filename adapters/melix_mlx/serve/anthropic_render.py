"""A Messages API response, whole or as Anthropic's server-sent events, from the Assembler.

Rules of this module:
- The text is built exactly as on the OpenAI routes (melix_mlx.serve.completion.Assembler:
  mlx-lm's text machine splits reasoning, tool calls and text; its tool parser reads the
  calls), then shaped as Anthropic content blocks: `thinking` first, `text`, then one
  `tool_use` block per call (its `input` the parsed arguments object).
- `stop_reason`: `tool_use` when a call was made, `max_tokens` at the budget,
  `stop_sequence` (with the sequence) when the row ended on one of the request's stop
  sequences (its last tokens are that sequence's tokens, as mlx-lm's stop matcher
  encodes it), else `end_turn` (an end-of-sequence token).
- Usage: `input_tokens` are the prompt tokens not read from the prompt cache,
  `cache_read_input_tokens` those that were; `output_tokens`; and the same `speculative`
  object the OpenAI routes report (melix_mlx.serve.usage).
- Streamed: `message_start`, then for each block `content_block_start`, its deltas
  (`text_delta`, `thinking_delta`, `input_json_delta`) and `content_block_stop`, a block
  closed when a block of another kind begins; then `message_delta` (stop reason, usage)
  and `message_stop`. Prefill progress is a `ping`. An error is an `error` event.
"""

from __future__ import annotations

import uuid
from typing import Any

from .anthropic_wire import tool_input
from .completion import Assembler
from .errors import anthropic_body
from .jsonout import dumps

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **payload})}\n\n"


def error_event(status: int, message: str) -> str:
    body = anthropic_body(status, message)
    return f"event: error\ndata: {dumps(body)}\n\n"


def tool_use_id(call: dict[str, Any]) -> str:
    given = str(call.get("id") or "")
    return given if given.startswith("toolu_") else f"toolu_{uuid.uuid4().hex[:24]}"


class MessageRenderer:
    """One Messages response over the request's Assembler (see the module rules)."""

    def __init__(self, asm: Assembler, stop_words: list[str], tokenizer: Any) -> None:
        self.asm = asm
        self.stop_words = stop_words
        self.tokenizer = tokenizer
        self.index = -1  # the open block's index (streamed)
        self.open: str | None = None  # the open block's kind

    # -- what both forms share ---------------------------------------------------------------
    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) once the Assembler is closed."""
        reason = self.asm.finish_reason
        if reason in STOP_REASONS:
            return STOP_REASONS[reason], None
        tokens = self.asm.tokens
        for word in self.stop_words:
            ids = list(self.tokenizer.encode(word, add_special_tokens=False))
            if ids and tokens[-len(ids) :] == ids:
                return "stop_sequence", word
        return "end_turn", None

    def usage(self) -> dict[str, Any]:
        ctx = self.asm.ctx
        cached = max(ctx.prompt_cache_count or 0, 0)
        out: dict[str, Any] = {
            "input_tokens": len(ctx.prompt) - cached,
            "output_tokens": len(self.asm.tokens),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }
        if getattr(ctx, "speculative", None) is not None:
            out["speculative"] = ctx.speculative
        return out

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.asm.parsed.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.asm.parsed.model,
        }

    # -- whole -----------------------------------------------------------------------------
    def whole(self) -> dict[str, Any]:
        message = self.asm.whole()["choices"][0]["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(call),
                    "name": function["name"],
                    "input": tool_input(function["arguments"]),
                }
            )
        reason, sequence = self.stop()
        return {
            **self._head(),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(),
        }

    # -- streamed ----------------------------------------------------------------------------
    def start(self) -> str:
        ctx = self.asm.ctx
        cached = max(ctx.prompt_cache_count or 0, 0)
        usage = {
            "input_tokens": len(ctx.prompt) - cached,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }
        message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return event("message_start", {"message": message}) + event("ping", {})

    def feed(self, gen: Any) -> str:
        """The events one generated response makes (possibly none)."""
        chunk = self.asm.feed(gen)
        return self._deltas(chunk) if chunk is not None else ""

    def _deltas(self, chunk: dict[str, Any]) -> str:
        delta = chunk["choices"][0].get("delta") or {}
        out = []
        if delta.get("reasoning"):
            out.append(self._open("thinking", {"thinking": "", "signature": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            out.append(self._open("text", {"text": ""}))
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            block = {"id": tool_use_id(call), "name": function["name"], "input": {}}
            out.append(self._open("tool_use", block, always=True))
            out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return "".join(out)

    def _open(self, kind: str, block: dict[str, Any], always: bool = False) -> str:
        if self.open == kind and not always:
            return ""
        out = self._close()
        self.index += 1
        self.open = kind
        return out + event(
            "content_block_start", {"index": self.index, "content_block": {"type": kind, **block}}
        )

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> str:
        if self.open is None:
            return ""
        out = ""
        if self.open == "thinking":
            out = self._delta({"type": "signature_delta", "signature": ""})
        self.open = None
        return out + event("content_block_stop", {"index": self.index})

    def finish(self) -> str:
        """The events after the last response: the last deltas, the stop reason and usage."""
        out = self._deltas(self.asm.final_chunk()) + self._close()
        reason, sequence = self.stop()
        out += event(
            "message_delta",
            {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": self.usage()},
        )
        return out + event("message_stop", {})
