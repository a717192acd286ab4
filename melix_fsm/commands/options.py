"""Command-line options shared by every command that starts a speculative decode.

Rules of this module:
- `melix-fsm receipt`, `generate` (and a server) take the same speculative and serving
  flags from here, so a command line that works for one works for the others and the
  receipt they print is the same (tests/adapters/test_cli_parity.py walks the parsers).
- Flags map one-to-one onto keyword arguments: the speculative ones onto
  `melix_fsm.config.speculative_config`, the KV ones onto mlx-lm's `generate_step`
  (`kv_bits`, `kv_group_size`, `quantized_kv_start`), the serving facts onto
  `melix_fsm.receipt.ServingContext`. An absent flag is None: "not given".
- No mlx import.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..config import DevicePolicy, Method, int_or_auto
from ..receipt import ServingContext

DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's generate_step defaults
DEFAULT_QUANTIZED_KV_START = 5000
QUANTIZED_KV_DEFAULT_BITS = 8  # what --quantized-kv means without --kv-bits
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize accepts
KV_GROUP_SIZES = (32, 64, 128)


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    """--method, --num-draft-tokens, --draft-model, --device-policy, --profile."""
    parser.add_argument("--method", choices=[m.value for m in Method], default=None, help="default: mtp")
    parser.add_argument(
        "--num-draft-tokens", type=int_or_auto, default=None, metavar="K|auto", help="auto: chosen live"
    )
    parser.add_argument("--draft-model", default=None, metavar="DIR", help="used with --method draft_model")
    parser.add_argument(
        "--device-policy",
        choices=[p.value for p in DevicePolicy],
        default=None,
        help="auto (default): measure the loaded model and speculate only where it pays",
    )
    parser.add_argument("--profile", default=None, metavar="FILE", help="TOML or JSON settings file")


def add_serving_options(parser: argparse.ArgumentParser) -> None:
    """The quantized KV cache (mlx-lm's flags) and the serving facts the receipt records."""
    parser.add_argument(
        "--quantized-kv",
        action="store_true",
        help=f"serve from a quantized KV cache ({QUANTIZED_KV_DEFAULT_BITS} bits unless --kv-bits)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        metavar="B",
        help="quantize the KV cache to B bits",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=None,
        metavar="G",
        help=f"KV quantization group size (default {DEFAULT_KV_GROUP_SIZE}; must divide the head dim)",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=None,
        metavar="N",
        help=f"quantize the KV cache once it holds N tokens (default {DEFAULT_QUANTIZED_KV_START})",
    )
    parser.add_argument("--chunked-prefill", action="store_true", help="serving prefills in chunks")
    parser.add_argument(
        "--batched", action="store_true", help="rows share batch caches (generate: the batched generator)"
    )


def kv_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """mlx-lm's keyword arguments for the KV cache; empty when it is not quantized.

    Raises ValueError (a usage error) for a negative start or KV flags without bits.
    """
    bits = args.kv_bits
    if bits is None and args.quantized_kv:
        bits = QUANTIZED_KV_DEFAULT_BITS
    start = args.quantized_kv_start
    if start is not None and start < 0:
        raise ValueError("--quantized-kv-start must be >= 0")
    if bits is None:
        if args.kv_group_size is not None or start is not None:
            raise ValueError("--kv-group-size / --quantized-kv-start need --kv-bits (or --quantized-kv)")
        return {}
    return {
        "kv_bits": bits,
        "kv_group_size": args.kv_group_size or DEFAULT_KV_GROUP_SIZE,
        "quantized_kv_start": DEFAULT_QUANTIZED_KV_START if start is None else start,
    }


def serving_context(args: argparse.Namespace, *, batched: bool = False) -> ServingContext:
    """The receipt's serving context for these flags (`batched`: rows share batch caches)."""
    quantized = args.quantized_kv or args.kv_bits is not None
    group = (args.kv_group_size or DEFAULT_KV_GROUP_SIZE) if quantized else None
    return ServingContext(
        quantized_kv=quantized,
        chunked_prefill=args.chunked_prefill,
        batched=batched or args.batched,
        kv_group_size=group,
    )
