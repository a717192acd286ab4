"""`melix-fsm receipt MODEL_DIR`: print the capability receipt of a speculative start as JSON.

Rules of this module:
- The flags (melix_fsm.commands.options, shared with `generate`) map one-to-one onto
  `melix_fsm.config.speculative_config` keyword arguments and the `ServingContext` (an
  absent flag is None: "not given"), so the CLI and the API build the same config and
  print byte-identical receipts.
- Exit status (melix_fsm.cli): 0 admitted or legacy_only (the operator chose plain decode),
  3 refused with a typed reason, 2 usage error or unreadable input (a bad flag or profile,
  or a receipt refused as unreadable_checkpoint). The receipt, when one was made, always
  goes to stdout; a one-line reason goes to stderr for statuses 2 and 3.
- `--schema` prints the receipt's JSON Schema (spec/receipt.schema.json is this output).
- MODEL_DIR and --draft-model take the names the plugins' commands take (the embedded
  checkpoints: `stdlib-tiny`, ...), looked up through the plugins (melix_fsm.cli.resolve_model).
- No mlx import; nothing here loads weights.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, resolve_model
from ..config import speculative_config
from ..errors import ConfigError
from ..reasons import RefusalReason
from ..receipt import Mode, Receipt, receipt_json, resolve, schema_json
from .options import add_serving_options, add_speculative_options, kv_arguments, serving_context


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "receipt",
        help="print the capability receipt for a speculative start (reads no tensors)",
        description="Resolve the speculative config for MODEL_DIR and print the receipt as JSON. "
        "Exit 0 admitted (or plain decode chosen), 3 refused with a typed reason, 2 usage error.",
    )
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="checkpoint directory or embedded name (stdlib-tiny, ...)",
    )
    add_speculative_options(parser)
    add_serving_options(parser)
    parser.add_argument("--schema", action="store_true", help="print the receipt JSON Schema and exit")
    parser.set_defaults(run=run)


def exit_status(receipt: Receipt) -> int:
    if receipt.refusal_reason is RefusalReason.unreadable_checkpoint:
        return EXIT_USAGE
    return EXIT_REFUSED if receipt.mode is Mode.refused else EXIT_OK


def run(args: argparse.Namespace) -> int:
    if args.schema:
        sys.stdout.buffer.write(schema_json())
        return EXIT_OK
    if not args.model_dir:
        print("melix-fsm receipt: error: MODEL_DIR is required", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = speculative_config(
            profile=args.profile,
            method=args.method,
            num_draft_tokens=args.num_draft_tokens,
            draft_model=resolve_model(args.draft_model) if args.draft_model else None,
            device_policy=args.device_policy,
        )
        kv_arguments(args)  # the same checks generate makes
    except (ConfigError, ValueError) as exc:
        print(f"melix-fsm receipt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    context = serving_context(args)
    receipt = resolve(resolve_model(args.model_dir), config, context=context)
    sys.stdout.buffer.write(receipt_json(receipt))
    sys.stdout.flush()
    status = exit_status(receipt)
    if status != EXIT_OK:
        assert receipt.refusal_reason is not None
        print(f"melix-fsm receipt: {receipt.refusal_reason.value}: {receipt.message}", file=sys.stderr)
    return status
