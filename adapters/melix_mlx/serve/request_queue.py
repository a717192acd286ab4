"""One request's generation context and response queue, shared by the HTTP side and the
generation thread.

Rules of this module:
- `SpeculativeContext` is mlx-lm's `GenerationContext` carrying the request's response
  queue and, once it finishes, its speculative usage (melix_mlx.serve.runtime binds it).
- `AsyncResponseQueue`: the generation thread puts, the HTTP event loop reads, and no
  HTTP thread ever blocks on a request; `cancel` works from any thread, in any state.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from mlx_lm.server import GenerationContext

from melix_fsm.errors import MelixError


class RequestCancelled(MelixError):
    """The request was cancelled before the generation thread started it."""


@dataclass
class SpeculativeContext(GenerationContext):
    queue: Any = None  # the request's response queue (set when mlx-lm queues the context)
    speculative: dict[str, Any] | None = None  # the usage's speculative object, once finished

    @property
    def cancelled(self) -> bool:
        return self._should_stop


class AsyncResponseQueue:
    """One request's responses: put by the generation thread, read on the event loop.

    `cancel` (any thread) stops the request wherever it is: before tokenization (the
    request's event), or through its context, whether that exists yet or not (a lock
    orders the two threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cancelled: threading.Event) -> None:
        self.loop = loop
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = cancelled  # the request's own event (ServedRequest.cancelled)
        self.ctx: SpeculativeContext | None = None
        self._lock = threading.Lock()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, SpeculativeContext):
            with self._lock:
                item.queue, self.ctx = self, item
                if self.cancelled.is_set():
                    item.stop()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled.set()
            if self.ctx is not None:
                self.ctx.stop()
