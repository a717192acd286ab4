"""uvicorn's h11 protocol with a deadline on a request's head and a JSON connection cap.

Rules:
- uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but waits for a
  request head forever. Here a connection must deliver a complete head within
  `head_timeout_s` of its first byte (of the connection, or after its previous
  response), or it is closed. The body has its own deadline in the route.
- uvicorn's `limit_concurrency` answers a text/plain 503; the same cap (open connections
  or running requests) is checked here instead and answered with the one error shape
  (melix_mlx.serve.errors), `Retry-After` and `Connection: close`. A request h11 cannot
  parse (a malformed or oversized head) gets its 400 in that shape too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import body_for, error_body

OVER_CAPACITY = "too many connections; retry later"


async def over_capacity(send: Any, path: str = "") -> None:
    body = json.dumps(body_for(path, 503, OVER_CAPACITY, code="over_capacity")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HeadTimeoutProtocol(H11Protocol):
    head_timeout_s: float = 10.0  # set per server (melix_mlx.serve.app)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cap, self.limit_concurrency = self.limit_concurrency, None  # checked in `_capped`
        self._inner_app = self.app
        self.app = self._capped

    async def _capped(self, scope: Any, receive: Any, send: Any) -> None:
        # uvicorn counted before adding this request's task; here it is already counted
        if self.cap is not None and (len(self.connections) >= self.cap or len(self.tasks) > self.cap):
            await over_capacity(send, scope.get("path", ""))
            return
        await self._inner_app(scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expired(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm()
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # the keep-alive timer covers the idle time until the next byte

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, f"malformed HTTP request: {msg}", code="bad_http")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        start = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for event in (start, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc: Any) -> None:
        self._disarm()
        super().connection_lost(exc)
