"""`melix-fsm serve`: an OpenAI-compatible server with batched MTP, on uvicorn + FastAPI.

Modules: app (start, drain and stop one server: uvicorn over the app and one generation
thread), routes (the HTTP API), protocol (a request body checked into mlx-lm's
generation arguments), completion (a response's text, as mlx-lm's handler builds it),
session (one accepted request: its machine, spec/request.toml, and its responses),
admission (in-flight limit, 429/503, drain), middleware (auth, JSON content type),
connections (a deadline on request heads), errors (the one error shape), limits (the
flags' dataclass), schemas (the OpenAPI bodies), privacy (no path or host detail in a
response), runtime (mlx-lm's generation loop with MTPBatchGenerator, chunked fair
prefill, cancellation), chunks (prompt segments cut into chunks), provider (the served
model, its receipt and policy), metrics (prometheus_client), usage (the nested
speculative usage object).
"""
