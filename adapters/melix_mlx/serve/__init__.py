"""`melix-fsm serve`: an OpenAI-compatible server with batched MTP on mlx-lm's own server.

Modules: provider (the served model, its receipt and policy; mlx-lm's ModelProvider),
runtime (mlx-lm's generation loop with MTPBatchGenerator), handler (mlx-lm's HTTP handler
with the receipt and metrics endpoints), metrics (prometheus_client), usage (the nested
speculative usage object), app (start and stop a server).
"""
