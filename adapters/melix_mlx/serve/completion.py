"""One response's text, built from the generation thread's tokens as mlx-lm's handler builds it.

Rules of this module:
- `Assembler` is mlx-lm's `APIHandler.handle_completion` loop without the socket: the
  text state machine strips control sequences and splits reasoning, tool calls and
  text; tool calls are formatted by mlx-lm's `ToolCallFormatter`; reasoning is sent as
  both `reasoning` (mlx-lm's key) and `reasoning_content`; the finish reason,
  logprobs and usage are mlx-lm's. `feed` takes one generated `Response` and returns the
  stream chunk it makes (or None); `final_chunk` / `whole` close it.
- The usage carries the request's `speculative` object (melix_mlx.serve.usage) once
  the generation thread has set it on the context.
"""

from __future__ import annotations

import time
from typing import Any

from mlx_lm.server import TextStateMachine, ToolCallFormatter

from .protocol import Parsed


class Assembler:
    def __init__(self, parsed: Parsed, ctx: Any, fingerprint: str) -> None:
        self.parsed = parsed
        self.ctx = ctx
        self.fingerprint = fingerprint
        self.created = int(time.time())
        self.tools = ToolCallFormatter(ctx.tool_parser, parsed.request.tools, parsed.stream)
        self.sm_state = ctx.text_sm.make_state(ctx.initial_state)
        self.prev_state = self.current_state = ctx.initial_state
        self.finish_reason = "stop"
        self.made_tool_call = False
        self.reasoning = self.tool_text = self.text = ""
        self.tool_calls: list[str] = []
        self.tokens: list[int] = []
        self.token_logprobs: list[float] = []
        self.top_tokens: list[Any] = []

    def feed(self, gen: Any) -> dict[str, Any] | None:
        """Take one generated response; the stream chunk it makes, if any."""
        if gen.finish_reason == "stop":
            self.sm_state, state = TextStateMachine.discard(self.sm_state)
            segments = [(state, "")]
        elif gen.finish_reason == "length":
            self.sm_state, segments = TextStateMachine.split(self.sm_state, gen.text)
            self.sm_state, flushed, state = TextStateMachine.flush(self.sm_state)
            segments.append((state, flushed))
        else:
            self.sm_state, segments = TextStateMachine.split(self.sm_state, gen.text)
        for state, clean in segments:
            if state == "reasoning":
                self.reasoning += clean
            elif state == "tool":
                self.tool_text += clean
            elif state == "normal":
                if self.prev_state == "tool":
                    self.tool_calls.append(self.tool_text)
                    self.tool_text = ""
                    self.made_tool_call = True
                self.text += clean
            self.prev_state = self.current_state = state
        self.tokens.append(gen.token)
        args = self.parsed.args
        if args.logprobs:
            self.token_logprobs.append(gen.logprob)
        if args.top_logprobs > 0:
            self.top_tokens.append(gen.top_tokens)
        if gen.finish_reason is not None:
            self.finish_reason = gen.finish_reason
        pending = self.text or self.tool_calls or self.reasoning
        if self.parsed.stream and self.current_state != "tool" and pending:
            return self._take(None)
        return None

    def _close(self) -> None:
        if self.prev_state == "tool" and self.tool_text:
            self.tool_calls.append(self.tool_text)
            self.tool_text = ""
            self.made_tool_call = True
        if self.finish_reason == "stop" and self.made_tool_call:
            self.finish_reason = "tool_calls"

    def _take(self, finish_reason: str | None) -> dict[str, Any]:
        chunk = self.response(
            self.text, finish_reason, tool_calls=self.tools(self.tool_calls), reasoning=self.reasoning
        )
        self.text = self.reasoning = ""
        self.tool_calls = []
        return chunk

    def final_chunk(self, finish_reason: str | None = None) -> dict[str, Any]:
        """The stream's last chunk (its finish reason; `finish_reason` overrides it)."""
        self._close()
        return self._take(finish_reason or self.finish_reason)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head("chat.completion"), "choices": [], "usage": self.usage()}

    def whole(self) -> dict[str, Any]:
        """The non-streamed response."""
        self._close()
        out = self.response(
            self.text, self.finish_reason, tool_calls=self.tools(self.tool_calls), reasoning=self.reasoning
        )
        out["usage"] = self.usage()
        return out

    def usage(self) -> dict[str, Any]:
        prompt, completion = len(self.ctx.prompt), len(self.tokens)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.ctx.prompt_cache_count is not None and self.ctx.prompt_cache_count >= 0:
            usage["prompt_tokens_details"] = {"cached_tokens": self.ctx.prompt_cache_count}
        if getattr(self.ctx, "speculative", None) is not None:
            usage["speculative"] = self.ctx.speculative
        return usage

    def _head(self, object_type: str) -> dict[str, Any]:
        return {
            "id": self.parsed.request_id,
            "system_fingerprint": self.fingerprint,
            "object": object_type,
            "model": self.parsed.model,
            "created": self.created,
        }

    def response(
        self, text: str, finish_reason: str | None, tool_calls: Any = None, reasoning: str = ""
    ) -> dict[str, Any]:
        """mlx-lm's `generate_response` (one choice, index 0)."""
        parsed = self.parsed
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if not parsed.stream:
            if self.top_tokens:
                content = [dict(i[0], top_logprobs=i) if i else {} for i in self.top_tokens]
                choice["logprobs"] = {"content": content}
            elif self.token_logprobs:
                choice["logprobs"] = {
                    "content": [dict(id=i, logprob=g) for i, g in zip(self.tokens, self.token_logprobs)]
                }
        if parsed.object_type.startswith("chat.completion"):
            key = "delta" if parsed.stream else "message"
            message: dict[str, Any] = {"role": "assistant"}
            if not parsed.stream:
                message["content"] = text if text else None
            elif text:
                message["content"] = text
            if reasoning:  # mlx-lm's key, and the one most clients read (vLLM's, DeepSeek's)
                message["reasoning"] = message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice[key] = message
        else:
            choice["text"] = text
        return {**self._head(parsed.object_type), "choices": [choice]}
