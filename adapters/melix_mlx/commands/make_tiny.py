"""`melix-fsm make-tiny FAMILY OUT_DIR`: write a tiny random checkpoint in a family's HF layout.

Rules of this module:
- A thin front for `melix_mlx.tools.tiny.make_tiny` (seeded, deterministic weights, MTP head
  included, byte-level tokenizer); prints the output directory.
- Exit status: 0 written, 2 usage error (unknown family, OUT_DIR not writable,
  --mtp-layers below 1, --vision with a family other than qwen3_5 / qwen3_5_moe or with
  other than the default weights).
- `--vision` writes the tiny vision-language checkpoint (melix_mlx.vlm.tiny: the embedded
  stdlib-hybrid wrapped with a one-block vision tower, the upstream Qwen3.5 VL layout
  that mlx-vlm loads): dense for qwen3_5, the Qwen3.5/3.6-MoE (35B-A3B) layout for
  qwen3_5_moe.
- The family list is repeated here so `register` does not import mlx; `run` checks it
  against `melix_mlx.tools.tiny.FAMILIES`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

FAMILIES = ("qwen3_5", "deepseek_v3", "mimo", "glm4_moe", "glm4_moe_lite", "qwen3_5_moe", "qwen3_next")
FAMILIES += ("ernie4_5_moe", "longcat_flash", "longcat_flash_ngram")
FAMILIES += ("deepseek_v32", "glm_moe_dsa")
FAMILIES += ("nemotron_h",)
FAMILIES += ("bailing_moe_v3", "bailing_hybrid")
FAMILIES += ("mimo_v2_flash", "step3p5", "exaone_moe")
FAMILIES += ("deepseek_v41",)
VISION_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # melix_mlx.vlm.tiny.FAMILIES, without importing mlx


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "make-tiny",
        help="write a tiny random checkpoint (with MTP head) in a family's HF layout",
        description="Write a tiny random-weight checkpoint of FAMILY into OUT_DIR.",
    )
    parser.add_argument("family", choices=FAMILIES, metavar="FAMILY", help=", ".join(FAMILIES))
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--mtp-layers", type=int, default=None, metavar="N", help="MTP head layers to write (default: 1)"
    )
    parser.add_argument(
        "--vision",
        action="store_true",
        help="qwen3_5 or qwen3_5_moe: the tiny vision-language checkpoint (the HF layout mlx-vlm loads)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from melix_mlx.tools.tiny import ALL_FAMILIES as BUILT
    from melix_mlx.tools.tiny import make_tiny

    if args.family not in BUILT:  # the two lists drifted apart
        print(f"melix-fsm make-tiny: error: unknown family {args.family!r}", file=sys.stderr)
        return 2
    if args.mtp_layers is not None and args.mtp_layers < 1:
        print("melix-fsm make-tiny: error: --mtp-layers must be >= 1", file=sys.stderr)
        return 2
    if args.vision:
        return _vision(args)
    try:
        out = make_tiny(
            args.family, args.out_dir, seed=args.seed, dtype=args.dtype, mtp_layers=args.mtp_layers
        )
    except OSError as exc:
        print(f"melix-fsm make-tiny: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _vision(args: argparse.Namespace) -> int:
    if args.family not in VISION_FAMILIES or args.mtp_layers is not None or args.dtype != "float32":
        print(
            "melix-fsm make-tiny: error: --vision writes the VL checkpoint of qwen3_5 or qwen3_5_moe "
            "only (float32, its one trained head layer)",
            file=sys.stderr,
        )
        return 2
    from melix_mlx.vlm.tiny import write_tiny_vl

    try:
        out = write_tiny_vl(args.out_dir, seed=args.seed, family=args.family)
    except OSError as exc:
        print(f"melix-fsm make-tiny: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
