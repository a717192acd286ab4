"""Start and stop one server: uvicorn serving the FastAPI app over one generation thread.

Rules of this module:
- `start_server` builds the generation side (mlx-lm's loop with MTPBatchGenerator,
  melix_mlx.serve.runtime), the app (melix_mlx.serve.routes) and a uvicorn server on a
  socket it binds itself (port 0: an ephemeral port; a bind error raises before
  anything runs). In the background (tests, tools) uvicorn runs on its own thread;
  in the foreground (the command) on the calling thread, with its signal handlers.
- uvicorn's own limits are set from `ServeLimits`: a connection cap
  (`limit_concurrency`, 503 beyond), the keep-alive timeout, h11's cap on a request
  head, a listen backlog of 2048, no server header; and a deadline on a request's head
  (melix_mlx.serve.connections: uvicorn has none).
- Drain (SIGTERM/SIGINT in the foreground, `drain()` otherwise): stop accepting, fail
  queued requests, let started ones finish up to the drain timeout, end the rest
  (melix_mlx.serve.admission); uvicorn then closes and returns. A signal is not
  re-raised afterwards (the command exits 0). `stop()` drains with a short timeout,
  stops the generation thread and joins both threads (bounded).
- mlx-lm's settings namespace is built here with mlx-lm's own defaults, except those
  the command sets (model, batch size, draft depth).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from mlx_lm.models.cache import LRUPromptCache

from ..runtime.prefill import vocabulary_size
from .admission import Admission
from .connections import HeadTimeoutProtocol
from .limits import ServeLimits, resolve
from .metrics import ServeMetrics
from .privacy import served_name
from .protocol import Defaults
from .provider import MTPModelProvider, ServedModel
from .routes import ServeState, build_app
from .runtime import ServingResponseGenerator

STOP_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0
BACKLOG = 2048
GRACE_S = 5.0  # uvicorn waits this long past the drain timeout before it cancels handlers


def mlx_settings(served: ServedModel, *, max_batch_size: int, max_tokens: int = 512) -> argparse.Namespace:
    """mlx-lm server settings (its CLI defaults) for this served model."""
    return argparse.Namespace(
        model=str(served.path),
        adapter_path=None,
        draft_model=None,
        num_draft_tokens=served.num_draft_tokens,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        allowed_origins=[],
        temp=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=max_tokens,
        chat_template_args={},
        decode_concurrency=max_batch_size,
        prompt_concurrency=min(8, max_batch_size),
        prefill_step_size=2048,
        prompt_cache_size=10,
        prompt_cache_bytes=None,
        kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=0,
        pipeline=False,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit begins the drain and never re-raises the signal."""

    admission: Admission
    drain_timeout_s: float
    lost: str | None = None  # why a sharded server lost a rank (melix_mlx.serve.ranks)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.begin_drain()

    def begin_drain(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._drain)
        else:
            self.should_exit = True

    def _drain(self) -> None:
        self.admission.drain(self.drain_timeout_s)
        self.should_exit = True  # uvicorn stops accepting, then waits for the handlers

    def lose(self, reason: str) -> None:
        """A rank of a sharded server is lost (any thread): every open request fails, then exit."""
        self.lost = reason
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._lose, reason)
        else:
            self.should_exit = True

    def _lose(self, reason: str) -> None:
        self.admission.fail_all(reason)
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


@dataclass
class RunningServer:
    server: DrainingServer
    generator: ServingResponseGenerator
    sock: socket.socket
    thread: threading.Thread | None
    state: ServeState

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.server.run(sockets=[self.sock])

    def drain(self) -> None:
        """Begin a drain, as SIGTERM would (returns at once)."""
        self.server.begin_drain()

    def stop(self) -> None:
        if self.thread is not None:
            self.server.drain_timeout_s = min(self.server.drain_timeout_s, 1.0)
            self.server.begin_drain()
            self.thread.join(STOP_TIMEOUT_S)
        self.sock.close()
        self.generator.stop(STOP_TIMEOUT_S)
        self.state.tokenizing.close()


def start_server(
    served: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch_size: int = 32,
    max_tokens_limit: int | None = None,
    names: tuple[str, ...] = (),
    served_model_name: str | None = None,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    background: bool = True,
    generator_class: type[ServingResponseGenerator] = ServingResponseGenerator,
    generator_options: dict[str, Any] | None = None,
) -> RunningServer:
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    limits = limits or ServeLimits()
    if max_tokens_limit is not None:
        limits = replace(limits, max_tokens_limit=max_tokens_limit)
    limits = resolve(limits, served.path)
    settings = mlx_settings(served, max_batch_size=max_batch_size)
    name = served_name(served.path, served_model_name)
    sock = _bind(host, port)
    capacity = max_batch_size + limits.max_queue
    generator = start_generator(
        served,
        max_batch_size=max_batch_size,
        limits=limits,
        names=(name, *names),
        generator_class=generator_class,
        **(generator_options or {}),
    )
    metrics = generator.metrics
    state = ServeState(
        generator=generator,
        metrics=metrics,
        admission=Admission(generator, metrics, capacity),
        limits=limits,
        served=served,
        names=list(dict.fromkeys((name, *names))),
        vocab=vocabulary_size(served.model) or 1 << 31,
        defaults=Defaults(
            max_tokens=min(settings.max_tokens, limits.max_tokens_limit),
            num_draft_tokens=served.num_draft_tokens,
        ),
        ranks=generator.ranks,
    )
    app = build_app(state, api_key=api_key, allowed_origins=allowed_origins)
    protocol = type("Protocol", (HeadTimeoutProtocol,), {"head_timeout_s": limits.head_timeout_s})
    config = uvicorn.Config(
        app,
        http=protocol,
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=True,
        limit_concurrency=limits.limit_concurrency,
        timeout_keep_alive=limits.timeout_keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        backlog=BACKLOG,
        timeout_graceful_shutdown=limits.drain_timeout_s + GRACE_S,
        lifespan="off",
    )
    server = DrainingServer(config)
    server.admission, server.drain_timeout_s = state.admission, limits.drain_timeout_s
    thread = None
    if background:
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="melix-serve-http", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    return RunningServer(server, generator, sock, thread, state)


def start_generator(
    served: ServedModel,
    *,
    max_batch_size: int,
    limits: ServeLimits,
    names: tuple[str, ...] = (),
    generator_class: type[ServingResponseGenerator] = ServingResponseGenerator,
    **options: Any,
) -> ServingResponseGenerator:
    """The generation side alone (its thread started): what a follower rank runs."""
    settings = mlx_settings(served, max_batch_size=max_batch_size)
    provider = MTPModelProvider(settings, served, names=names)
    metrics = ServeMetrics(served.controller, served.method)
    prompt_cache = LRUPromptCache(settings.prompt_cache_size)
    metrics.watch_prompt_cache(prompt_cache)
    return generator_class(
        provider,
        prompt_cache,
        metrics,
        queue_size=max_batch_size + limits.max_queue,
        prefill_chunk=limits.prefill_chunk_tokens,
        prefill_budget_s=limits.prefill_budget_s,
        memory_trim_s=limits.memory_trim_s,
        **options,
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)  # clients may connect (and wait) before uvicorn's loop runs
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
