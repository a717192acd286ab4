"""One OpenAI error object for every refusal of the server.

Rules of this module:
- Every error the server answers is `{"error": {"message", "type", "param", "code"}}`
  (OpenAI's shape), whichever layer refuses: validation, auth, limits, routing, a fault;
  except under the Anthropic Messages API's paths (`/v1/messages...`, `anthropic_path`),
  where it is Anthropic's: `{"type": "error", "error": {"type", "message"}}`, with
  Anthropic's error types for the same status codes.
- `ApiError` is raised anywhere in the request path and rendered by the app's handler;
  Starlette's own HTTP errors (404, 405) and FastAPI's validation errors are rendered
  in the same shape. Messages never carry paths or host details.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from melix_fsm.errors import MelixError

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether `path` is one of the Messages API's (its errors take Anthropic's shape)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class ApiError(MelixError):
    """A refusal with its HTTP status, rendered as the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error body in the shape `path`'s API uses."""
    if anthropic_path(path):
        return anthropic_body(status, message)
    return error_body(status, message, param, code)


def error_response(exc: ApiError, path: str = "") -> JSONResponse:
    return JSONResponse(
        body_for(path, exc.status, exc.message, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


def install_handlers(app: FastAPI) -> None:
    """Render every error of `app` in the one shape."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc, request.url.path)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        error = ApiError(exc.status_code, message, headers=dict(exc.headers or {}))
        return error_response(error, request.url.path)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(400, "the request is not valid", code="invalid_request")
        return error_response(error, request.url.path)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logging.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        error = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        return error_response(error, request.url.path)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
