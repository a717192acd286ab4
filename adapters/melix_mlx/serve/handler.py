"""mlx-lm's HTTP handler, plus the receipt and metrics endpoints and stricter input checks.

Rules of this module:
- mlx-lm's `APIHandler` does the HTTP work: parsing, chat templates, streaming, usage.
  This subclass adds GET /v1/melix/receipt (the startup receipt, the served settings and
  the live policy's state) and GET /metrics (Prometheus text), answers GET /v1/models
  with the one model it serves (mlx-lm's lists a local hub cache instead), and nests the request's
  `speculative` object into `usage` (non-streamed responses and the streamed usage chunk).
- Bad input is a 4xx JSON error before anything reaches the generation thread: unknown
  routes (404), wrong field types, max_tokens that is a bool or above the server's limit,
  a prompt that is not a string, messages that are not a list of objects, stop words that
  are not strings (400), on top of mlx-lm's own checks.
- A request whose decoding raised ends with a 500 JSON error (non-streamed) or a final
  `data: {"error": ...}` event (streamed: the 200 header is already out); the server keeps
  serving. A client that went away is not an error.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mlx_lm.server import APIHandler

from .metrics import CONTENT_TYPE
from .runtime import current_context

POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class MelixAPIHandler(APIHandler):
    max_tokens_limit: int = 1 << 16  # set per server (melix_mlx.serve.app)
    timeout = 300  # seconds a socket read or write may stall: a stuck client frees its thread

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        logging.debug("%s - %s", self.address_string(), format % args)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    # -- routes ----------------------------------------------------------------------
    def do_GET(self) -> None:
        if self.path == "/v1/melix/receipt":
            self._json(200, self._receipt())
        elif self.path == "/metrics":
            body = self.response_generator.metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/v1/models":
            self._json(200, self._models())
        elif self.path == "/health":
            super().do_GET()
        else:
            self._error(404, f"no route GET {self.path}", "not_found")

    def do_POST(self) -> None:
        if self.path not in POST_ROUTES:
            self._error(404, f"no route POST {self.path}", "not_found")
            return
        super().do_POST()

    def _models(self) -> dict[str, Any]:
        """The one model served (under its path and the names it answers to)."""
        names = self.response_generator.model_provider.served_names()
        card = {"object": "model", "created": self.created, "owned_by": "melix-fsm"}
        return {"object": "list", "data": [{"id": name, **card} for name in names]}

    def _receipt(self) -> dict[str, Any]:
        served = self.response_generator.served
        controller = served.controller
        return {
            "model": str(served.path),
            "method": served.method,
            "settings": served.settings,
            "num_draft_tokens": served.num_draft_tokens if served.method != "none" else 0,
            "refusal": served.refusal,
            "head_load_error": served.head_load_error,
            "receipt": served.receipt,
            "policy": controller.summary() if controller is not None else None,
        }

    # -- input checks ----------------------------------------------------------------
    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        if isinstance(self.max_tokens, bool):
            raise ValueError("max_tokens must be of type int")
        if self.max_tokens > self.max_tokens_limit:
            raise ValueError(f"max_tokens must be at most {self.max_tokens_limit}")
        body = self.body
        if self.path == "/v1/completions":
            if not isinstance(body.get("prompt"), str):
                raise ValueError("prompt must be a string")
        elif not isinstance(body.get("messages"), list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in body["messages"]
        ):
            raise ValueError("messages must be a list of objects with a string role")
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise ValueError("stop must be a string or a list of strings")

    # -- responses -------------------------------------------------------------------
    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        try:
            super().handle_completion(request, stop_words)
        except DISCONNECTS:
            logging.info("client went away; its row is freed at the next step")
        except Exception as exc:
            logging.warning("request failed: %s: %s", type(exc).__name__, exc)
            message = {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": 500}
            try:
                if self.stream:  # the 200 header is out: end the stream with an error event
                    self.wfile.write(f"data: {json.dumps({'error': message})}\n\n".encode())
                    self.wfile.flush()
                else:
                    self._headers_buffer = []  # drop the buffered 200 status line
                    self._json(500, {"error": message})
            except DISCONNECTS:
                pass

    def generate_response(self, *args: Any, **kwargs: Any) -> dict:
        response = super().generate_response(*args, **kwargs)
        if "usage" in response:
            self._add_speculative(response["usage"])
        return response

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> dict:
        response = super().completion_usage_response(*args, **kwargs)
        self._add_speculative(response["usage"])
        return response

    @staticmethod
    def _add_speculative(usage: dict[str, Any]) -> None:
        ctx = current_context()
        if ctx is not None and ctx.speculative is not None:
            usage["speculative"] = ctx.speculative
