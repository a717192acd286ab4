"""`melix-fsm serve`: an OpenAI-compatible HTTP server decoding with batched MTP.

Rules of this module:
- Endpoints are mlx-lm's server's (/v1/completions, /v1/chat/completions, streaming or
  not, /v1/models, /health) plus GET /v1/melix/receipt and GET /metrics
  (melix_mlx.serve). Concurrent requests are continuously batched with MTP on.
- Options: every `melix-fsm receipt` option, from the same definitions
  (melix_fsm.commands.options), with the same meaning, acting on the served decoder:
  `--method` (mtp, draft_model with `--draft-model`, none), `--num-draft-tokens`,
  `--device-policy`, `--profile`, the quantized-KV flags, `--chunked-prefill`;
  `--batched` changes nothing (a server always batches).
- The model is `--model DIR` or an embedded alias, default stdlib-tiny. The receipt is
  resolved for a batched start before the weights are read and printed on stderr at
  start (`melix-fsm serve: receipt: {...}`), the same one GET /v1/melix/receipt returns.
  A refusal when the method was not given serves plainly and says so in the receipt
  and in every response's usage; a refused explicit method, or settings no batch can
  run (a quantized KV cache), exit 3 with the typed reason before anything is loaded.
- Exit status (melix_fsm.cli): 0 after Ctrl-C or SIGTERM, 2 usage error or unreadable
  checkpoint, 3 typed refusal (the receipt as JSON on stdout, the reason on stderr).
  mlx is imported inside `run` only.
- Shutdown: the HTTP server and the generation thread are stopped and joined, the
  standard streams flushed, then the process ends with `os._exit`: mlx's runtime can
  abort during interpreter teardown once a server thread has used it (mlx-lm's own
  server exits with SIGABRT intermittently the same way), and nothing is left to run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3
PROG = "melix-fsm serve"


def register(subparsers: Any) -> None:
    from melix_fsm.commands.options import add_serving_options, add_speculative_options  # no mlx

    parser = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API with batched MTP decoding",
        description="An OpenAI-compatible HTTP server (mlx-lm's) whose batches decode with the "
        "checkpoint's MTP head (or a draft model). Exit 0 after Ctrl-C, 2 usage error or unreadable "
        "checkpoint, 3 typed refusal.",
    )
    parser.add_argument(
        "--model", default=None, metavar="DIR",
        help="checkpoint directory or embedded name (stdlib-tiny, stdlib-hybrid; default: stdlib-tiny)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    add_speculative_options(parser)
    add_serving_options(parser)
    parser.add_argument("--max-batch-size", type=int, default=32, metavar="N", help="rows decoded together")
    parser.add_argument(
        "--max-tokens-limit", type=int, default=1 << 16, metavar="N", help="the largest max_tokens accepted"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(run=run)


def _fail(message: str, status: int = EXIT_USAGE) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def load_from_args(args: argparse.Namespace) -> Any:
    """The `ServedModel` these parsed options describe (raises ValueError on a bad KV flag,
    melix_mlx.serve.provider.ServeRefused / ServeError when the server cannot start)."""
    from melix_fsm.commands.options import kv_arguments
    from melix_mlx.serve.provider import load_served_model

    return load_served_model(
        args.model,
        args.num_draft_tokens,
        args.device_policy,
        method=args.method,
        draft_model=args.draft_model,
        profile=args.profile,
        kv=kv_arguments(args),
        chunked_prefill=args.chunked_prefill,
    )


def run(args: argparse.Namespace) -> int:
    if args.max_batch_size < 1:
        return _fail("--max-batch-size must be >= 1")
    if args.max_tokens_limit < 1:
        return _fail("--max-tokens-limit must be >= 1")
    if not 0 <= args.port < 65536:
        return _fail("--port must be within [0, 65535]")
    import json
    import logging

    from melix_mlx.serve.app import start_server
    from melix_mlx.serve.provider import ServeError, ServeRefused

    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(message)s")
    try:
        served = load_from_args(args)
    except ServeRefused as exc:
        print(json.dumps({"error": exc.reason.value, "message": exc.message, "receipt": exc.receipt}))
        return _fail(str(exc), EXIT_REFUSED)
    except (ServeError, ValueError) as exc:
        return _fail(str(exc))
    print(f"{PROG}: receipt: {json.dumps(served.receipt, separators=(',', ':'))}", file=sys.stderr)
    names = (args.model,) if args.model else ("stdlib-tiny",)
    try:
        server = start_server(
            served,
            host=args.host,
            port=args.port,
            max_batch_size=args.max_batch_size,
            max_tokens_limit=args.max_tokens_limit,
            names=names,
            background=False,
        )
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    note = f" (refused: {served.refusal})" if served.refusal else ""
    print(
        f"{PROG}: {served.path} on {server.url} method={served.method}{note} "
        f"k={served.num_draft_tokens if served.method != 'none' else 0} max_batch_size={args.max_batch_size}",
        file=sys.stderr,
        flush=True,
    )
    import os
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Both installed explicitly: a process started in the background of a script inherits
    # SIGINT ignored, and Python then leaves it ignored (Ctrl-C / kill -INT would do nothing).
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print(f"{PROG}: stopped", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_OK)
