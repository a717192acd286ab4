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
- The HTTP front is uvicorn with a FastAPI app (melix_mlx.serve.app); its limits are
  flags (`ServeLimits`: body, prompt tokens, max_tokens, logit_bias, stop list, queue,
  timeouts, prefill chunk, connections, keep-alive, memory trim). `--mlx-cache-limit`
  bounds mlx's buffer cache for the whole process, before anything loads
  (melix_mlx.serve.memory). `--api-key` (or MELIX_FSM_API_KEY) requires a
  Bearer token on every route but /health; `--allowed-origins` enables CORS for those
  origins only (none by default). Models are named `--served-model-name` (default: the
  checkpoint directory's base name); no response names a path.
- Exit status (melix_fsm.cli): 0 after Ctrl-C or SIGTERM, 2 usage error or unreadable
  checkpoint, 3 typed refusal (the receipt as JSON on stdout, the reason on stderr).
  mlx is imported inside `run` only.
- Shutdown (SIGTERM/SIGINT): stop accepting, fail queued requests, let started ones
  finish up to `--drain-timeout`, end the rest with an error; a second signal forces it.
  Then the generation thread is stopped and joined, the standard streams flushed, and
  the process ends with `os._exit(0)`: mlx's runtime can abort during interpreter
  teardown once a server thread has used it, and nothing is left to run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3
RANK_TIMEOUT_S = 60.0  # melix_mlx.serve.ranks.RANK_TIMEOUT_S (no mlx imported here)
PROG = "melix-fsm serve"
API_KEY_ENV = "MELIX_FSM_API_KEY"

# (flag, ServeLimits field, type, help): each limit of the server, with its default there
LIMIT_FLAGS = (
    ("--max-body-bytes", "max_body_bytes", int, "largest request body (413 beyond)"),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "longest prompt (default: the model's context)"),
    ("--context-length", "context_tokens", int, "the model's context in tokens (default: its config's)"),
    ("--max-logit-bias", "max_logit_bias", int, "most logit_bias entries of a request"),
    ("--max-stop", "max_stop", int, "most stop sequences of a request"),
    ("--max-queue", "max_queue", int, "requests waiting beyond the batch's rows (429 beyond)"),
    ("--request-timeout", "request_timeout_s", float, "seconds a request may run before it is cancelled"),
    ("--drain-timeout", "drain_timeout_s", float, "seconds started requests may finish after SIGTERM"),
    ("--prefill-chunk-tokens", "prefill_chunk_tokens", int, "prompt tokens a request prefills per step"),
    ("--prefill-budget", "prefill_budget_s", float, "seconds of prompt prefill per step, measured"),
    ("--limit-concurrency", "limit_concurrency", int, "open connections (503 beyond)"),
    (("--keep-alive-timeout", "--timeout-keep-alive"), "timeout_keep_alive_s", int,
     "seconds an idle keep-alive connection stays open (above common clients' pool expiry)"),
    ("--head-timeout", "head_timeout_s", float, "seconds a request's head may take to arrive"),
    ("--body-timeout", "body_timeout_s", float, "seconds a request's body may take to arrive"),
    ("--memory-trim-interval", "memory_trim_s", float,
     "seconds between returns of malloc's free memory to the system (0: never)"),
)


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
    from melix_mlx.serve.limits import ServeLimits  # no mlx

    defaults = ServeLimits()
    for flag, field, kind, text in LIMIT_FLAGS:
        default = getattr(defaults, field)
        shown = f"{text} (default {default:g})" if default is not None else text
        flags = (flag,) if isinstance(flag, str) else flag  # a second spelling: uvicorn's
        parser.add_argument(*flags, dest=field, type=kind, default=None, metavar="N", help=shown)
    parser.add_argument(
        "--mlx-cache-limit", type=int, default=None, metavar="MB",
        help="bound mlx's cache of freed buffers at this many MB (default: mlx's own bound; "
        "melix_mlx.serve.memory)",
    )
    parser.add_argument(
        "--api-key", default=None,
        help=f"require this Bearer token on every route but /health (or ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
        help="origins allowed cross-origin access (CORS); none by default",
    )
    parser.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the model id clients see and send (default: the checkpoint directory's base name)",
    )
    parser.add_argument(
        "--sharding", choices=["tensor", "pipeline"], default=None,
        help="under mlx.launch: shard the model over the ranks (rank 0 serves HTTP; docs/distributed.md)",
    )
    parser.add_argument(
        "--rank-timeout", type=float, default=None, metavar="S",
        help="sharded: seconds a collective may take before the server ends as rank_lost (default 60)",
    )
    vision = parser.add_argument_group("images (a vision-language checkpoint through mlx-vlm; docs/vlm.md)")
    vision.add_argument("--vision", action="store_true", help="load with mlx-vlm: chats may carry images")
    vision.add_argument("--max-images", type=int, default=4, metavar="N", help="images per request")
    vision.add_argument(
        "--max-image-bytes", type=int, default=4 << 20, metavar="N", help="bytes of one image (413 beyond)"
    )
    vision.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image urls")
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
        sharding=args.sharding,
        vision=vision_from_args(args),
    )


def vision_from_args(args: argparse.Namespace) -> Any:
    """The image bounds of `--vision` (melix_mlx.serve.images.VisionOptions), None without it."""
    if not getattr(args, "vision", False):
        return None
    from melix_mlx.serve.images import VisionOptions

    return VisionOptions(
        max_images=args.max_images,
        max_image_bytes=args.max_image_bytes,
        allow_remote=args.allow_remote_images,
    )


def limits_from_args(args: argparse.Namespace) -> Any:
    from melix_mlx.serve.limits import ServeLimits

    values = {field: getattr(args, field) for _, field, _, _ in LIMIT_FLAGS}
    given = {field: value for field, value in values.items() if value is not None}
    return ServeLimits(max_tokens_limit=args.max_tokens_limit, **given)


def _problems(args: argparse.Namespace, limits: Any) -> list[str]:
    from melix_mlx.serve.limits import check

    problems = []
    if args.max_batch_size < 1:
        problems.append("--max-batch-size must be >= 1")
    if args.max_tokens_limit < 1:
        problems.append("--max-tokens-limit must be >= 1")
    if not 0 <= args.port < 65536:
        problems.append("--port must be within [0, 65535]")
    problems += check(limits)
    if args.rank_timeout is not None and not args.rank_timeout > 0:
        problems.append("--rank-timeout must be > 0")
    if args.mlx_cache_limit is not None and args.mlx_cache_limit < 0:
        problems.append("--mlx-cache-limit must be >= 0")
    if getattr(args, "max_images", 1) < 1 or getattr(args, "max_image_bytes", 1) < 1:
        problems.append("--max-images and --max-image-bytes must be >= 1")
    return problems


def run(args: argparse.Namespace) -> int:
    limits = limits_from_args(args)
    problems = _problems(args, limits)
    if problems:
        return _fail("; ".join(problems))
    import json

    from melix_mlx.runtime.distributed import init_group
    from melix_mlx.serve.app import start_server
    from melix_mlx.serve.provider import ServeError, ServeRefused

    if args.mlx_cache_limit is not None:  # process-wide: set before anything is loaded
        from melix_mlx.serve.memory import apply_cache_limit

        apply_cache_limit(args.mlx_cache_limit << 20)
    group = init_group()
    rank, ranks = group.rank(), group.size()
    if ranks > 1 and args.sharding is None:
        return _fail(f"launched on {ranks} ranks: give --sharding tensor|pipeline")
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(message)s")
    if ranks > 1:
        print(f"{PROG}: rank {rank}/{ranks} pid {os.getpid()}", file=sys.stderr, flush=True)
    try:
        served = load_from_args(args)
    except ServeRefused as exc:
        if rank == 0:  # every rank refuses alike (decided from the config); one line on stdout
            print(json.dumps({"error": exc.reason.value, "message": exc.message, "receipt": exc.receipt}))
        return _fail(str(exc), EXIT_REFUSED)
    except (ServeError, ValueError) as exc:
        return _fail(str(exc))
    options = _rank_options(args) if ranks > 1 else {}
    if rank != 0:
        return _follow(served, args, limits, options)
    print(f"{PROG}: receipt: {json.dumps(served.receipt, separators=(',', ':'))}", file=sys.stderr)
    names = (args.model,) if args.model else ("stdlib-tiny",)
    try:
        server = start_server(
            served,
            host=args.host,
            port=args.port,
            max_batch_size=args.max_batch_size,
            names=names,
            served_model_name=args.served_model_name,
            limits=limits,
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            allowed_origins=args.allowed_origins,
            background=False,
            **options,
        )
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc}")
    if ranks > 1:
        _bind_loss(server, limits)
    note = f" (refused: {served.refusal})" if served.refusal else ""
    print(
        f"{PROG}: {server.state.names[0]} on {server.url} method={served.method}{note} "
        f"k={served.num_draft_tokens if served.method != 'none' else 0} max_batch_size={args.max_batch_size}",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn installs its SIGINT/SIGTERM handlers itself (also where SIGINT was inherited
    # ignored, as in a background job of a script); they begin the drain
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    lost = getattr(server.generator, "lost", None)
    if lost is not None:  # a sharded server lost a rank: its requests failed; exit typed, 4
        from melix_mlx.serve.ranks import exit_lost

        exit_lost(lost)
    return _stopped()


def _stopped() -> int:
    print(f"{PROG}: stopped", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_OK)


def _bind_loss(server: Any, limits: Any) -> None:
    """Rank 0: a lost rank fails every open request, then the server exits 4 (bounded)."""
    import threading

    from melix_mlx.serve.app import GRACE_S
    from melix_mlx.serve.ranks import exit_lost

    def on_lost(error: Any) -> None:
        print(f"{PROG}: rank lost: {error}", file=sys.stderr, flush=True)
        server.server.lose(f"a rank of this sharded server was lost: {error}")
        # uvicorn returns once the failed handlers end; should it not, this ends the process
        backstop = threading.Timer(limits.drain_timeout_s + 2 * GRACE_S, exit_lost, (error,))
        backstop.daemon = True
        backstop.start()

    server.generator.bind(on_lost)


def _rank_options(args: argparse.Namespace) -> dict[str, Any]:
    """`start_server`'s options on a rank of a sharded server (melix_mlx.serve.ranks)."""
    from melix_mlx.serve.ranks import DistributedResponseGenerator

    return {"generator_class": DistributedResponseGenerator,
            "generator_options": {"rank_timeout_s": args.rank_timeout or RANK_TIMEOUT_S}}


def _follow(served: Any, args: argparse.Namespace, limits: Any, options: dict[str, Any]) -> int:
    """A follower rank: no HTTP; it replays rank 0's turns until rank 0's shutdown."""
    from melix_mlx.serve.app import start_generator
    from melix_mlx.serve.limits import resolve
    from melix_mlx.serve.ranks import follow

    limits = resolve(limits, served.path)
    generator = start_generator(
        served, max_batch_size=args.max_batch_size, limits=limits, **options["generator_options"],
        generator_class=options["generator_class"],
    )
    follow(generator, drain_timeout_s=limits.drain_timeout_s)
    return _stopped()
