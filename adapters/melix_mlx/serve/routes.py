"""The HTTP API: a FastAPI app over the generation thread (see melix_mlx.serve.app).

Rules of this module:
- Routes: POST /v1/completions and /v1/chat/completions (also /chat/completions, as
  mlx-lm), streamed as server-sent events or not; the Anthropic Messages API, POST
  /v1/messages (melix_mlx.serve.anthropic_wire, anthropic_render: the same batch, the
  same machine, Anthropic's shapes) and /v1/messages/count_tokens; GET /v1/models, /health,
  /v1/melix/receipt, /metrics; the OpenAPI schema at /openapi.json (no docs pages:
  they would load scripts from a CDN).
- A POST is read within the body limit (413) and deadline (408), decoded as UTF-8 JSON (400), checked
  (melix_mlx.serve.protocol), tokenized on the tokenizer thread (melix_mlx.serve.prompt_work:
  a prompt the template or the prompt limit refuses is a 400), admitted
  (melix_mlx.serve.admission: 429/503), then answered from its `Submission`. A
  fault in the request's own decoding a 500 (non-streamed) or a final error event
  (streamed: the 200 is out), and the server goes on.
- A client that disconnects cancels its request in any state (a watcher task reads
  the ASGI disconnect); a request past its deadline is cancelled (504, or an error
  event); a drain ends queued requests with 503 and, at its timeout, started ones with
  503 or, streamed, a last chunk with finish_reason "abort", an error event and [DONE];
  so does a lost rank of a sharded server (`rank_lost`). A seeded request joins the
  batch like any other (melix_mlx.serve.seeded), on a sharded server too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import types
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from melix_fsm.request import RequestEvent

from .admission import Admission
from .anthropic_render import MessageRenderer, error_event, event
from .anthropic_wire import parse_count, parse_messages
from .completion import Assembler
from .errors import ApiError, error_body, install_handlers
from .jsonout import dumps
from .limits import ServeLimits
from .metrics import CONTENT_TYPE
from .privacy import FINGERPRINT, redact, scrub
from .prompt_work import Tokenizing, tokenize, tokens
from .protocol import Defaults, Parsed, parse
from .schemas import chat_body, completion_body, count_tokens_body, messages_body
from .session import Aborted, Submission, is_bad_input

ABORT_FINISH = "abort"  # the finish reason of a stream the server ended
ANTHROPIC_HEADERS = ["x-api-key", "anthropic-version", "anthropic-beta"]  # allowed cross-origin


@dataclass
class ServeState:
    generator: Any
    metrics: Any
    admission: Admission
    limits: ServeLimits
    served: Any
    names: list[str]  # the served name first
    vocab: int
    defaults: Defaults
    created: int = field(default_factory=lambda: int(time.time()))
    ranks: int = 1  # processes the model is sharded over (melix_mlx.serve.ranks)
    tokenizing: Tokenizing = field(default_factory=Tokenizing)  # the tokenizer thread (prompt_work)


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The body as JSON, read within `limit` bytes and `timeout_s` (see the module rules)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(413 if length.isdigit() else 400, f"the request body may be at most {limit} bytes")
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body may be at most {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        return json.loads(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", code="invalid_encoding") from None
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None


def aborted_error(exc: Aborted) -> ApiError:
    if exc.event is RequestEvent.cancel:
        return ApiError(504, exc.reason, code="timeout")
    return ApiError(503, exc.reason, code=exc.event.value)


def fault_error(exc: BaseException) -> ApiError:
    return ApiError(500, redact(f"{type(exc).__name__}: {exc}"), code="request_failed")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {dumps(payload)}\n\n"


async def watch_disconnect(request: Request, sub: Submission, admission: Admission) -> None:
    """Cancel `sub` when its client goes away (the ASGI disconnect message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            sub.abort(RequestEvent.cancel, "the client disconnected")
            admission.release(sub)
            return


async def stream_events(state: ServeState, sub: Submission, asm: Assembler, watcher: asyncio.Task) -> Any:
    try:
        async for item in sub.responses():
            if isinstance(item, tuple):  # prefill progress: a comment keeps the connection alive
                yield f": keepalive {item[0]}/{item[1]}\n\n"
                continue
            chunk = asm.feed(item)
            if chunk is not None:
                yield sse(chunk)
        yield sse(asm.final_chunk())
        if sub.parsed.include_usage:
            yield sse(asm.usage_chunk())
        yield "data: [DONE]\n\n"
    except Aborted as exc:
        error = aborted_error(exc)
        yield sse(asm.final_chunk(ABORT_FINISH))
        yield sse(error_body(error.status, error.message, code=error.code))
        yield "data: [DONE]\n\n"
    except Exception as exc:  # this request's fault: its stream ends with an error event
        error = fault_error(exc)
        yield sse(error_body(error.status, error.message, code=error.code))
    finally:
        watcher.cancel()
        state.admission.release(sub)


async def accept(state: ServeState, request: Request, parsed: Parsed) -> tuple[Submission, asyncio.Task, Any]:
    """Tokenize `parsed` (off the generation thread), admit it and wait for its context
    (the generation thread took it); the submission, its disconnect watcher and the
    context. On a refusal both are released."""
    parsed.request.tokenized = await tokenized(state, parsed.request, parsed.args)
    sub = Submission(parsed, asyncio.get_running_loop(), state.limits.request_timeout_s)
    state.admission.admit(sub)
    watcher = asyncio.create_task(watch_disconnect(request, sub, state.admission))
    try:
        return sub, watcher, await sub.context()
    except Aborted as exc:
        raise aborted_error(exc) from None
    except Exception as exc:
        if is_bad_input(exc):
            raise ApiError(400, redact(str(exc)), code="invalid_prompt") from None
        raise fault_error(exc) from None
    finally:
        if sub.ctx is None:
            watcher.cancel()
            state.admission.release(sub)


async def tokenized(state: ServeState, request: Any, args: Any, checked: bool = True) -> tuple:
    """The request's tokens, made on the tokenizer thread (melix_mlx.serve.prompt_work);
    a prompt the template or the limit refuses is a 400."""
    fn = tokenize if checked else tokens  # unchecked: count_tokens
    try:
        return await state.tokenizing.run(fn, state.generator, state.served.tokenizer, request, args)
    except ApiError:  # a refused image (melix_mlx.serve.images) keeps its status
        raise
    except Exception as exc:
        if is_bad_input(exc):
            raise ApiError(400, redact(str(exc)), code="invalid_prompt") from None
        raise fault_error(exc) from None


async def drain_responses(sub: Submission, feed: Any) -> None:
    """Feed every generated response of a non-streamed request to `feed`."""
    try:
        async for item in sub.responses():
            if not isinstance(item, tuple):
                feed(item)
    except Aborted as exc:
        raise aborted_error(exc) from None
    except Exception as exc:
        raise fault_error(exc) from None


async def complete(state: ServeState, request: Request, chat: bool) -> Response:
    body = await read_json(request, state.limits.max_body_bytes, state.limits.body_timeout_s)
    parsed: Parsed = parse(
        body, chat, limits=state.limits, vocab=state.vocab, names=state.names, defaults=state.defaults
    )
    sub, watcher, ctx = await accept(state, request, parsed)
    streaming = False
    try:
        asm = Assembler(parsed, ctx, FINGERPRINT)
        if parsed.stream:
            streaming = True
            return StreamingResponse(
                stream_events(state, sub, asm, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await drain_responses(sub, asm.feed)
        return Response(dumps(asm.whole()), media_type="application/json")
    finally:
        if not streaming:
            watcher.cancel()
            state.admission.release(sub)


async def message_events(
    state: ServeState, sub: Submission, out: MessageRenderer, watcher: asyncio.Task
) -> Any:
    """A Messages request's stream (melix_mlx.serve.anthropic_render)."""
    try:
        yield out.start()
        async for item in sub.responses():
            if isinstance(item, tuple):  # prefill progress keeps the connection alive
                yield event("ping", {})
                continue
            text = out.feed(item)
            if text:
                yield text
        yield out.finish()
    except Aborted as exc:
        error = aborted_error(exc)
        yield error_event(error.status, error.message)
    except Exception as exc:  # this request's fault: its stream ends with an error event
        error = fault_error(exc)
        yield error_event(error.status, error.message)
    finally:
        watcher.cancel()
        state.admission.release(sub)


async def messages(state: ServeState, request: Request) -> Response:
    """POST /v1/messages: the Anthropic Messages API over the same batch."""
    body = await read_json(request, state.limits.max_body_bytes, state.limits.body_timeout_s)
    parsed, _ = parse_messages(
        body, limits=state.limits, vocab=state.vocab, names=state.names, defaults=state.defaults
    )
    sub, watcher, ctx = await accept(state, request, parsed)
    streaming = False
    try:
        asm = Assembler(parsed, ctx, FINGERPRINT)
        out = MessageRenderer(asm, parsed.args.stop_words, state.served.tokenizer)
        if parsed.stream:
            streaming = True
            return StreamingResponse(
                message_events(state, sub, out, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await drain_responses(sub, out.asm.feed)
        return Response(dumps(out.whole()), media_type="application/json")
    finally:
        if not streaming:
            watcher.cancel()
            state.admission.release(sub)


async def count_tokens(state: ServeState, request: Request) -> dict[str, Any]:
    """POST /v1/messages/count_tokens: the prompt's tokens under the chat template."""
    body = await read_json(request, state.limits.max_body_bytes, state.limits.body_timeout_s)
    served, kwargs = parse_count(body, limits=state.limits, names=state.names)
    args = types.SimpleNamespace(chat_template_kwargs=kwargs)
    prompt = (await tokenized(state, served, args, checked=False))[0]  # counted, whatever its length
    return {"input_tokens": len(prompt)}


def receipt_body(state: ServeState) -> dict[str, Any]:
    """GET /v1/melix/receipt: what the server runs and why (before the path is scrubbed)."""
    served, controller = state.served, state.served.controller
    return {
        "model": state.names[0],
        "method": served.method,
        "settings": served.settings,
        "num_draft_tokens": served.num_draft_tokens if served.method != "none" else 0,
        "refusal": served.refusal,
        "head_load_error": served.head_load_error,
        "receipt": served.receipt,
        "policy": controller.summary() if controller is not None else None,
    }


def build_app(
    state: ServeState, *, api_key: str | None = None, allowed_origins: list[str] | None = None
) -> FastAPI:
    from fastapi.middleware.cors import CORSMiddleware

    from melix_fsm import __version__

    from .middleware import Guard

    app = FastAPI(title="melix-fsm serve", version=__version__, docs_url=None, redoc_url=None)
    install_handlers(app)
    receipt_names = {str(state.served.path): state.names[0]}

    @app.post("/v1/completions", openapi_extra=completion_body(state.limits, state.vocab), tags=["openai"])
    async def completions(request: Request) -> Response:
        return await complete(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=chat_body(state.limits, state.vocab), tags=["openai"])
    async def chat_completions(request: Request) -> Response:
        return await complete(state, request, chat=True)

    @app.post("/chat/completions", include_in_schema=False)
    async def chat_alias(request: Request) -> Response:
        return await complete(state, request, chat=True)

    @app.post("/v1/messages", openapi_extra=messages_body(state.limits, state.vocab), tags=["anthropic"])
    async def anthropic_messages(request: Request) -> Response:
        return await messages(state, request)

    @app.post("/v1/messages/count_tokens", openapi_extra=count_tokens_body(state.limits), tags=["anthropic"])
    async def anthropic_count_tokens(request: Request) -> dict[str, Any]:
        return await count_tokens(state, request)

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        card = {"object": "model", "created": state.created, "owned_by": "melix-fsm"}
        return {"object": "list", "data": [{"id": name, **card} for name in state.names]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in state.names:
            raise ApiError(
                404, f"model {model_id[:100]!r} is not served here", param="model", code="model_not_found"
            )
        return {"id": model_id, "object": "model", "created": state.created, "owned_by": "melix-fsm"}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.generator.generation_available() and not state.admission.draining
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/melix/receipt", tags=["melix"])
    async def receipt() -> dict[str, Any]:
        return scrub(receipt_body(state), receipt_names)

    @app.get("/metrics", tags=["melix"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Guard, api_key=api_key)
    if allowed_origins:  # outermost: a preflight is answered before auth
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", *ANTHROPIC_HEADERS],
        )
    with contextlib.suppress(Exception):
        app.openapi()  # built once at start: a schema error fails the start, not a client
    return app
