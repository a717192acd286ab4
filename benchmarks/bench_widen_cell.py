"""One bench cell (MTP at depth k vs mlx-lm) on a widened checkpoint: single-sequence, or
a batch of B rows (MTPBatchGenerator vs mlx-lm's BatchGenerator).

Usage:
    python benchmarks/bench_widen_cell.py [--model stdlib-hybrid-wide] [--k 2] [--repeats 6]
        [--max-tokens 48] [--batch-size B [--requests-per-slot N]] [--temp T]
        [--regime openblas|reference|current]

The cell is `melix_mlx.tools.bench.Bench.single_cell` (or `batch_cell` with --batch-size) as
`melix-fsm bench` runs it (held-out prompts from the checkpoint's training report, cut
short by default; the methods interleaved per repeat; the A/A control on; the ideal ratio
from a calibration at the cell's batch size; auto beside forced-on), without the depth
chooser and the draft-model cells: a realistic-size cell in minutes. Re-executes itself
in the regime (the BLAS must be loaded before mlx). Prints the cell as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))

from melix_mlx.commands.bench import reexec_in_regime  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="stdlib-hybrid-wide", help="folder, embedded name or widened preset")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--prompt-chars",
        type=int,
        default=400,
        help="cut each held-out prompt to its first N characters (~130 tokens; 0 keeps them whole): "
        "a realistic-size prefill of 450-700 tokens costs seconds on a CPU",
    )
    p.add_argument("--no-aa-control", action="store_true", help="skip mlx-lm's second run per repeat")
    p.add_argument("--batch-size", type=int, default=0, help="0: the single-sequence cell; B: a batch cell")
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="a batch cell queues B x N held-out prompts for its B rows (a finished row takes the next)",
    )
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--regime", choices=["openblas", "reference", "current"], default="openblas")
    args = p.parse_args()
    if args.regime != "current":
        reexec_in_regime(args.regime)

    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.bench import Bench
    from melix_mlx.tools.bench_results import regime
    from melix_mlx.tools.workloads import Prompt, held_out_prompts

    path = resolve_model(args.model)
    started = time.perf_counter()
    prompts = held_out_prompts(path)
    if args.prompt_chars > 0:
        prompts = [Prompt(p.workload, p.text[: args.prompt_chars], p.source) for p in prompts]

    def tick(n: int) -> None:
        print(f"  repeat done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    bench = Bench.open(
        path,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        prompts=prompts,
        aa_control=not args.no_aa_control,
        requests_per_slot=args.requests_per_slot,
        progress=tick,
    )
    bench.calibrate([max(args.batch_size, 1)], [args.k])
    print(f"calibrated in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.batch_size:
        cell = vars(bench.batch_cell(args.batch_size, args.k, args.temp))
    else:
        cell = vars(bench.single_cell(args.k, args.temp))
    out = {
        "model": args.model,
        "path": str(path),
        "bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
        "regime": regime(),
        "wall_s": time.perf_counter() - started,
        "prompt_tokens": [len(t) for t in bench.prompts],
        "cell": cell,
    }
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
