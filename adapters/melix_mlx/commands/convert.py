"""`melix-fsm convert HF_DIR OUT_DIR`: convert a checkpoint for mlx-lm, keeping its MTP head.

Rules of this module:
- A thin front for `melix_mlx.loading.convert.convert`: the main model goes through mlx-lm's
  own conversion (optionally quantized with `-q`), the head is kept in
  `mtp.safetensors` with its norms repaired once, recorded in config.json.
- `--split-head` writes only the head, as a sidecar pack in the split-drafter layout
  (`melix_mlx.loading.head_pack.write_pack`), for a head-less conversion to take.
- Exit status: 0 converted; 2 usage error or unreadable input (OUT_DIR not empty,
  HF_DIR unreadable); 3 a typed refusal (`HeadLoadError`: the head is missing, has the
  wrong shapes, or the family is unsupported), reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

PROG = "melix-fsm convert"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint for mlx-lm, keeping its MTP head",
        description="Convert HF_DIR into OUT_DIR (must be absent or empty). "
        "Exit 0 ok, 2 usage error or unreadable input, 3 head refused with a typed reason.",
    )
    parser.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory or embedded name")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize the main model")
    parser.add_argument("--q-bits", type=int, default=4, metavar="B")
    parser.add_argument("--q-group-size", type=int, default=64, metavar="G")
    parser.add_argument(
        "--split-head",
        action="store_true",
        help="write only the MTP head, as a sidecar pack in the split-drafter layout "
        "(the layout of published MTP head repositories; see docs/vlm.md)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.loading.convert import convert
    from melix_mlx.loading.errors import HeadLoadError

    try:
        if args.split_head:
            out = _split_head(resolve_model(args.hf_dir), args.out_dir)
        else:
            out = convert(
                resolve_model(args.hf_dir),
                args.out_dir,
                quantize=args.quantize,
                q_bits=args.q_bits,
                q_group_size=args.q_group_size,
            )
    except HeadLoadError as exc:
        print(f"{PROG}: {exc.reason}: {exc}", file=sys.stderr)
        return 3
    except (OSError, ValueError, KeyError) as exc:
        print(f"{PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _split_head(source: Any, out_dir: str) -> Any:
    from pathlib import Path

    from melix_mlx.loading.head_pack import write_pack

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    return write_pack(source, out)
