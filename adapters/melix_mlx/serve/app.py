"""Start and stop one server: mlx-lm's HTTP server with this package's generator.

Rules of this module:
- `start_server` binds (port 0: an ephemeral port), starts mlx-lm's generation thread and
  an HTTP thread, and returns a `RunningServer` whose `stop()` shuts both down and waits
  for them (bounded). The command runs the same server in the foreground.
- mlx-lm's settings namespace is built here with mlx-lm's own defaults, except those
  the command sets (model, batch size, draft depth).
"""

from __future__ import annotations

import argparse
import socket
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import get_system_fingerprint

from .handler import MelixAPIHandler
from .metrics import ServeMetrics
from .provider import MTPModelProvider, ServedModel
from .runtime import ServingResponseGenerator

STOP_TIMEOUT_S = 30.0


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
        allowed_origins=["*"],
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


@dataclass
class RunningServer:
    httpd: ThreadingHTTPServer
    generator: ServingResponseGenerator
    thread: threading.Thread | None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        if self.thread is not None:  # a foreground serve_forever has returned already
            self.httpd.shutdown()
        self.httpd.server_close()
        self.generator._stop = True  # mlx-lm's loop checks it every iteration
        self.generator._generation_thread.join(STOP_TIMEOUT_S)
        if self.thread is not None:
            self.thread.join(STOP_TIMEOUT_S)


def start_server(
    served: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch_size: int = 32,
    max_tokens_limit: int = 1 << 16,
    names: tuple[str, ...] = (),
    background: bool = True,
    generator_class: type[ServingResponseGenerator] = ServingResponseGenerator,
) -> RunningServer:
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    settings = mlx_settings(served, max_batch_size=max_batch_size)
    provider = MTPModelProvider(settings, served, names=names)
    metrics = ServeMetrics(served.controller, served.method)
    generator = generator_class(provider, LRUPromptCache(settings.prompt_cache_size), metrics)
    fingerprint = get_system_fingerprint()
    limit = max_tokens_limit

    class Handler(MelixAPIHandler):
        max_tokens_limit = limit

    def handler(*args: Any, **kwargs: Any) -> Handler:
        return Handler(generator, *args, system_fingerprint=fingerprint, **kwargs)

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MelixHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
    try:
        httpd = server_class((host, port), handler)
    except OSError:
        generator.stop_and_join()
        raise
    httpd.daemon_threads = True
    thread = None
    if background:
        thread = threading.Thread(target=httpd.serve_forever, name="melix-serve-http", daemon=True)
        thread.start()
    return RunningServer(httpd, generator, thread)
