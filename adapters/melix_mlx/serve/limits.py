"""The server's limits: one dataclass, each field a `melix-fsm serve` flag.

Rules: every limit has a default that keeps one client from hurting the others or the
process; `resolve` fills the ones that depend on the model (the prompt-token limit
defaults to the model's context and is never longer than it; `--context-length` states
the context where the checkpoint's config is not what the server should take, e.g. a
latency run with a prompt longer than a tiny checkpoint was trained on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_CONTEXT = 4096  # a checkpoint that names no context length


@dataclass(frozen=True)
class ServeLimits:
    max_body_bytes: int = 1 << 20  # a request body (JSON) larger than this is a 413
    max_prompt_tokens: int | None = None  # None: the model's context
    context_tokens: int | None = None  # the model's context; None: its config.json's
    max_tokens_limit: int = 1 << 16  # the largest max_tokens accepted
    max_logit_bias: int = 300  # logit_bias entries (OpenAI's own cap)
    max_stop: int = 16  # stop sequences
    max_stop_chars: int = 256  # characters of one stop sequence
    max_messages: int = 1024  # chat messages of one request
    max_queue: int = 64  # accepted requests waiting beyond the batch's rows (429 beyond)
    request_timeout_s: float = 600.0  # a request still running after this is cancelled
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT, how long started requests may finish
    prefill_chunk_tokens: int = 256  # a prompt is prefilled in chunks of at most this
    prefill_budget_s: float = 0.25  # and each step prefills at most about this long (measured)
    limit_concurrency: int = 256  # open connections (uvicorn answers 503 beyond)
    # an idle keep-alive connection is closed after this: longer than the idle expiry of
    # common clients' pools (httpx 5 s, under the openai and anthropic clients; aiohttp 15 s),
    # so the client drops it first, never the server while a request is sent on it
    timeout_keep_alive_s: int = 30
    max_header_bytes: int = 16 * 1024  # h11's cap on a request's head
    head_timeout_s: float = 10.0  # a request's head must arrive within this (slowloris)
    body_timeout_s: float = 30.0  # and its body within this (408 beyond)
    # malloc's free pages go back to the system this often (0: never; serve.memory), so the
    # resident set follows the live bytes, not the heap's high-water mark
    memory_trim_s: float = 10.0


def model_context(path: Path) -> int:
    """The checkpoint's context length (config.json), DEFAULT_CONTEXT if it names none."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return DEFAULT_CONTEXT


def resolve(limits: ServeLimits, path: Path) -> ServeLimits:
    """`limits` with the prompt-token limit set: at most the model's context."""
    context = limits.context_tokens or model_context(path)
    wanted = limits.max_prompt_tokens
    return replace(limits, max_prompt_tokens=context if wanted is None else min(wanted, context))


def check(limits: ServeLimits) -> list[str]:
    """What is wrong with these limits (as flag messages); empty when they are usable."""
    problems = []
    for name in (
        "max_body_bytes",
        "max_tokens_limit",
        "max_stop",
        "max_stop_chars",
        "max_messages",
        "prefill_chunk_tokens",
        "limit_concurrency",
        "max_header_bytes",
    ):
        if getattr(limits, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_logit_bias", "max_queue"):
        if getattr(limits, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0")
    if limits.memory_trim_s < 0:
        problems.append("--memory-trim-interval must be >= 0")
    if limits.timeout_keep_alive_s < 0:
        problems.append("--keep-alive-timeout must be >= 0")
    for name in (
        "request_timeout_s",
        "drain_timeout_s",
        "head_timeout_s",
        "body_timeout_s",
        "prefill_budget_s",
    ):
        if not getattr(limits, name) > 0:
            problems.append(f"--{name.replace('_s', '').replace('_', '-')} must be > 0")
    if limits.max_prompt_tokens is not None and limits.max_prompt_tokens < 1:
        problems.append("--max-prompt-tokens must be >= 1")
    if limits.context_tokens is not None and limits.context_tokens < 1:
        problems.append("--context-length must be >= 1")
    return problems
