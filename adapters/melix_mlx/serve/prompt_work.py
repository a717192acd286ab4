"""Prompt work off the decode path: tokenization before the queue, prefill within a time budget.

Rules of this module:
- Tokenization (the chat template and the encoding) runs on the HTTP side, on one
  tokenizer thread per server (`Tokenizing`), before the request is admitted: the
  generation thread never tokenizes, and an empty or too long prompt is refused (400)
  before it takes a place in the queue. The generation thread takes the tokens as given
  (`ServedRequest.tokenized`); a sharded server's ranks receive them with the request.
- While rows decode or other requests wait, each generator step spends at most about
  `budget_s` of prefill on queued prompts (`PrefillBudget`): a pending segment longer
  than what the budget allows is cut, and the rest waits for the next step, between the
  running rows' decode steps. A prompt that prefills alone (no row runs, nothing else
  queued) is not cut below the chunk limit: small pieces only cost it time, and a
  request that arrives meanwhile waits for at most the one chunk in flight. What the
  budget allows is measured, not assumed: prompt tokens per second over the latest
  pieces (an average that follows the cost's growth with the context); before the first
  measurement a probe piece of `PROBE` tokens is cut. A piece is never shorter than
  `MIN_PIECE` tokens nor longer than the chunk limit (`prefill_chunk`). The last piece
  of a prompt, prefilled when its row joins the batch, is cut to the same size at
  insertion (melix_mlx.serve.chunks).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlx_lm.server import ResponseGenerator

from melix_fsm.errors import MelixError

PROBE = 32  # tokens of the first piece, before any measurement
MIN_PIECE = 32  # the fewest tokens a piece prefills: progress, and a forward's overhead amortized


class PromptRejected(MelixError, ValueError):
    """The tokenized prompt is empty or longer than the server's limit (a 400)."""


def tokenize(generator: Any, tokenizer: Any, request: Any, args: Any) -> tuple:
    """mlx-lm's tokenization of a request (its `_tokenize`), checked against the limit."""
    from .images import tokenize as with_images  # image parts: mlx-vlm's processor

    out = with_images(generator, tokenizer, request, args) or ResponseGenerator._tokenize(
        generator, tokenizer, request, args
    )
    prompt, limit = out[0], getattr(request, "max_prompt_tokens", 0)
    if not len(prompt):
        raise PromptRejected("the prompt is empty after tokenization")
    if limit and len(prompt) > limit:
        raise PromptRejected(f"the prompt has {len(prompt)} tokens; this server accepts at most {limit}")
    return out


class Tokenizing:
    """One server's tokenizer thread (see the module rules)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="melix-tokenize")

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class PrefillBudget:
    """How many prompt tokens a step may prefill within `budget_s` (see the module rules)."""

    def __init__(self, budget_s: float | None, chunk: int) -> None:
        self.budget_s = budget_s
        self.chunk = chunk
        self.rate: float | None = None  # prompt tokens per second, measured

    def piece(self) -> int:
        if self.budget_s is None:  # no budget: fixed chunks
            return self.chunk
        if self.rate is None:
            return min(PROBE, self.chunk)
        return max(MIN_PIECE, min(self.chunk, int(self.rate * self.budget_s)))

    def cut(self, pending: list[Any], alone: bool = False) -> int:
        """Cut the next segment of each pending request to its share (uncut `alone`: no
        row runs and nothing else waits); the tokens the next segments hold."""
        if self.budget_s is not None and pending and not alone:
            share = max(MIN_PIECE, self.piece() // len(pending))
            for request in pending:
                head = request.segments[0]
                if len(head) > share:
                    request.segments[0:1] = [head[:share], head[share:]]
        return sum(len(request.segments[0]) for request in pending)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else 0.5 * (self.rate + rate)


class Clock:
    """Seconds of one stretch of work (a context manager)."""

    def __enter__(self) -> Clock:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start
