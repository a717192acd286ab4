"""How close the calibrated plain step is to the plain step decoding runs.

    python benchmarks/bench_plain_calibration.py --model stdlib-hybrid --regime openblas --repeats 6

The live controller compares speculative throughput with the *calibrated* plain step (one
forward, synced: `melix_mlx.runtime.calibrate`) until a plain window is measured, and its margin
for putting off the first plain probe (`LiveConfig.defer_plain_above`) must cover how far
the live plain step runs from it (BENCHMARKS.md, "Tenth round"). This script measures
that: forced-off decoding (the single-sequence decoder, and the batched generator at each
`--batch-sizes`) with a `LiveController` fed every step, whose plain rate is the live
plain tokens/s weighted so that the calibrated plain scores 1.0. Runs alternate between
the paths; prints one JSON object with the median and min-max per path.
"""

from __future__ import annotations

import argparse
import json
import statistics

from melix_mlx.commands.bench import reexec_in_regime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--regime", choices=("reference", "openblas"), default="reference")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    reexec_in_regime(args.regime)

    import mlx.core as mx
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.bench import Bench, _run_batch

    from melix_fsm.policy.controller import LiveController

    bench = Bench.open(resolve_model(args.model), max_tokens=args.max_tokens)
    model, head = bench.model, bench.head
    bench.calibrate(args.batch_sizes, [1])
    table = bench.timings.get(1)
    if table is None:
        raise SystemExit(f"calibration failed: {bench.failures[1]}")

    def plain_over_calibrated(path: str, batch_size: int, seed: int) -> float:
        controller = LiveController(table, policy="force_off", depth=1, batch_size=batch_size)
        mx.random.seed(seed)
        batch = bench._prompts(batch_size)
        if path == "single":
            bench._mtp_single(batch[0], 1, 0.0, seed, controller=controller)
        else:
            options = {"max_tokens": args.max_tokens, "controller": controller, **bench._slots(batch_size)}
            _run_batch(MTPBatchGenerator(model, head, num_draft_tokens=1, **options), batch, args.max_tokens)
        return controller.plain.value

    paths = [("single", 1)] + [("batch", b) for b in args.batch_sizes]
    ratios: dict[str, list[float]] = {f"{p} {b}": [] for p, b in paths}
    for r in range(args.repeats):
        for path, b in paths if r % 2 == 0 else paths[::-1]:
            ratios[f"{path} {b}"].append(plain_over_calibrated(path, b, r))
    out = {"model": args.model, "regime": args.regime, "repeats": args.repeats}
    out["live_plain_over_calibrated"] = {
        name: {"median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in ratios.items()
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
