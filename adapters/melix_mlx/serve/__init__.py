"""`melix-fsm serve`: an OpenAI- and Anthropic-compatible server with batched MTP, on uvicorn + FastAPI.

Modules: app (start, drain and stop one server: uvicorn over the app and one generation
thread), routes (the HTTP API), protocol (an OpenAI request body checked into mlx-lm's
generation arguments), anthropic_wire (a Messages API body, msgspec structs, into the
same request), anthropic_render (a Messages response, whole or as Anthropic's events),
completion (a response's text, as mlx-lm's handler builds it), session (one accepted
request: its machine, spec/request.toml, and its responses), admission (in-flight
limit, 429/503, drain), middleware (auth, JSON content type), connections (a deadline
on request heads), errors (the error shapes of both APIs), jsonout (strict JSON out),
limits (the flags' dataclass), schemas (the OpenAPI bodies), privacy (no path or host
detail in a response), runtime (mlx-lm's generation loop with MTPBatchGenerator, fair
prefill, cancellation), prompt_work (tokenization off the generation thread, prefill
within a time budget per step), seeded (each row's sampler and processors: a seeded
row's own random stream), chunks (prompt segments cut into chunks), provider (the served
model, its receipt and policy), metrics (prometheus_client), usage (the nested
speculative usage object).
"""
