"""`melix-fsm widen SRC DST --hidden H`: a larger checkpoint computing the same function.

Rules of this module:
- A thin front for `melix_mlx.tools.widen_io.widen_checkpoint` (rules in `melix_mlx.tools.widen`):
  SRC is a folder or an embedded name (`stdlib-tiny`, `stdlib-hybrid`); head counts and
  MLP width scale with H unless given; prints the output folder and its size.
- `--preset NAME` writes one of `melix_mlx.tools.widen_presets.PRESETS` (SRC and sizes fixed);
  the same names resolve as `--model` aliases elsewhere, generated on first use.
- Exit status: 0 written, 2 bad input (one line on stderr, no traceback): H smaller than
  the source, head counts that break the grouping, an unsupported layout, DST present
  without --force, SRC not a checkpoint.
- No mlx import: widening is numpy over safetensors.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "widen",
        help="write a larger checkpoint computing the same function (realistic-size benchmarks)",
        description=(
            "Widen checkpoint SRC (a folder or an embedded name) to hidden size H and write it to "
            "DST: new dims, heads and MLP units are read by zero output projections, so tokens, "
            "logits and MTP acceptance stay the source's."
        ),
    )
    parser.add_argument("src", nargs="?", metavar="SRC", help="checkpoint folder or embedded name")
    parser.add_argument("dst", nargs="?", metavar="DST", help="output folder")
    parser.add_argument("--hidden", type=int, metavar="H", help="widened hidden size (>= the source's)")
    parser.add_argument("--intermediate", type=int, metavar="N", help="MLP width (default: scales with H)")
    parser.add_argument("--heads", type=int, metavar="N", help="attention heads (default: scales with H)")
    parser.add_argument("--kv-heads", type=int, metavar="N", help="attention key/value heads (Qwen3.5)")
    parser.add_argument("--linear-key-heads", type=int, metavar="N", help="GatedDeltaNet key heads")
    parser.add_argument("--linear-value-heads", type=int, metavar="N", help="GatedDeltaNet value heads")
    parser.add_argument(
        "--preset", metavar="NAME", help="write a named preset (source, sizes fixed) to DST or the cache"
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the new input-side weights")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.set_defaults(run=run)


def _fail(message: str) -> int:
    print(f"melix-fsm widen: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.widen import Sizes, WidenError
    from melix_mlx.tools.widen_io import widen_checkpoint
    from melix_mlx.tools.widen_presets import PRESETS, ensure

    try:
        if args.preset is not None:
            if args.preset not in PRESETS:
                return _fail(f"unknown preset {args.preset!r} (known: {', '.join(PRESETS)})")
            if args.src is not None and args.dst is not None:
                return _fail("--preset takes at most DST")
            dst = args.src  # with --preset the only positional is DST
            source = resolve_model(PRESETS[args.preset][0])
            out = ensure(args.preset, source, None if dst is None else Path(dst), force=args.force)
        else:
            if args.src is None or args.dst is None or args.hidden is None:
                return _fail("SRC, DST and --hidden H are required (or --preset NAME)")
            sizes = Sizes(
                hidden=args.hidden,
                intermediate=args.intermediate,
                heads=args.heads,
                kv_heads=args.kv_heads,
                linear_key_heads=args.linear_key_heads,
                linear_value_heads=args.linear_value_heads,
            )
            out = Path(args.dst)
            widen_checkpoint(resolve_model(args.src), out, sizes, seed=args.seed, force=args.force)
    except WidenError as exc:
        return _fail(str(exc))
    except (OSError, KeyError, ValueError) as exc:  # unreadable source, malformed config
        return _fail(f"{type(exc).__name__}: {exc}")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{out}\t{size / 1e9:.2f} GB")
    return 0
