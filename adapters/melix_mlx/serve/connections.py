"""uvicorn's h11 protocol with a deadline on a request's head (slowloris).

Rules: uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but waits for a
request head forever. Here a connection must deliver a complete head within
`head_timeout_s` of its first byte (of the connection, or after its previous response),
or it is closed. The body has its own deadline in the route (melix_mlx.serve.routes).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutProtocol(H11Protocol):
    head_timeout_s: float = 10.0  # set per server (melix_mlx.serve.app)

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

    def connection_lost(self, exc: Any) -> None:
        self._disarm()
        super().connection_lost(exc)
