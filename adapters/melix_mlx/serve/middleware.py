"""The checks every request passes before a route sees it: auth and content type.

Rules of this module (a pure ASGI middleware, so streamed responses pass untouched):
- With an API key, every route but /health needs `Authorization: Bearer <key>` or
  (Anthropic's header) `x-api-key: <key>`, compared in constant time; otherwise 401
  with `WWW-Authenticate: Bearer`. Refusals take the error shape of the path's API
  (melix_mlx.serve.errors.body_for).
- A POST body must be JSON: `Content-Type: application/json` (any parameters), else 415.
  A text/plain body is exactly what a web page can send without a CORS preflight.
- CORS is not here: Starlette's CORSMiddleware wraps this one when origins are allowed
  (so a preflight is answered before auth), and without it no CORS header is sent.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from .errors import body_for

OPEN_PATHS = frozenset({"/health"})


class Guard:
    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, extra = refusal
        body = json.dumps(body_for(scope.get("path", ""), status, message)).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope: dict, headers: dict[bytes, bytes]) -> tuple[int, str, list] | None:
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
            keyed = hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)
            if not (bearer or keyed):
                return (
                    401,
                    "a valid API key is required (Authorization: Bearer, or x-api-key)",
                    [(b"www-authenticate", b"Bearer")],
                )
        if scope.get("method") == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                return 415, "the request body must be application/json", []
        return None
