"""Auto with and without the probe horizon, interleaved in one run.

    python benchmarks/bench_probe_horizon.py --model stdlib-hybrid --regime openblas \
        --max-tokens 64 --ks 1 2 --batch-sizes 1 --repeats 6

The live controller starts a scheduled probe only while the run can still emit
`LiveConfig.probe_min_remaining` tokens (docs/device_policy.md). This script runs, per
cell and repeat, in ABBA order: mlx-lm's plain path, MTP forced on, auto with the
horizon off (`probe_min_remaining=0`, every probe runs, the rule before it) and auto as
shipped. The cells are the bench's: `single` (one prompt per repeat, mlx-lm's
`stream_generate` as the baseline) and `batch` B (a fixed batch, `BatchGenerator`). It
prints one JSON line per cell: the median (min-max) of horizon-on over horizon-off, and
of each auto over plain and over the better of plain and forced on, with the counters of
the auto runs summed over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

from melix_mlx.commands.bench import reexec_in_regime

COUNTERS = ("plain_probes", "probes", "probes_skipped_short", "suspend_decisions", "steps_suspended", "steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-hybrid")
    parser.add_argument("--regime", choices=("reference", "openblas"), default="openblas")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-single", action="store_true", help="batch cells only")
    args = parser.parse_args()
    reexec_in_regime(args.regime)

    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.tools.bench import Bench, _interleaved, _run_batch, _sampler
    from mlx_lm.generate import BatchGenerator

    from melix_fsm.policy.controller import LiveController
    from melix_fsm.policy.live_types import LiveConfig

    bench = Bench.open(resolve_model(args.model), max_tokens=args.max_tokens)
    model, head = bench.model, bench.head
    bench.calibrate(sorted({1, *args.batch_sizes}), args.ks)
    configs = {"horizon_off": LiveConfig(probe_min_remaining=0), "horizon_on": LiveConfig()}

    def single_plain(prompt: list[int], seed: int) -> float:
        return bench._plain_single(prompt, 0.0, seed=seed)[0]

    def single_run(k: int, prompt: list[int], seed: int, ctrl: LiveController | None) -> float:
        return bench._mtp_single(prompt, k, 0.0, seed, controller=ctrl)[0]

    def batch_run(k: int, batch_size: int, ctrl: LiveController | None) -> float:
        options = {"max_tokens": args.max_tokens, "sampler": _sampler(0.0, True), **bench._slots(batch_size)}
        gen = MTPBatchGenerator(model, head, num_draft_tokens=k, controller=ctrl, **options)
        return _run_batch(gen, bench._prompts(batch_size), args.max_tokens)[0]

    def batch_plain(batch_size: int) -> float:
        options = {"max_tokens": args.max_tokens, "sampler": _sampler(0.0, False), **bench._slots(batch_size)}
        base = BatchGenerator(model, **options)
        tps = _run_batch(base, bench._prompts(batch_size), args.max_tokens)[0]
        base.close()
        return tps

    cells = ([] if args.no_single else [("single", 1)]) + [("batch", b) for b in args.batch_sizes]
    for k in args.ks:
        for path, batch_size in cells:
            tps: dict[str, list[float]] = {}
            counters = {name: dict.fromkeys(COUNTERS, 0) for name in configs}
            for r in range(args.repeats):
                ctrls = {
                    name: bench.auto_controller(k, batch_size, config=cfg) for name, cfg in configs.items()
                }
                if path == "single":
                    prompt = bench.prompts[r % len(bench.prompts)]
                    runs = {"plain": partial(single_plain, prompt, r)}
                    runs |= {name: partial(single_run, k, prompt, r, ctrl) for name, ctrl in ctrls.items()}
                    runs["forced_on"] = partial(single_run, k, prompt, r, None)
                else:
                    runs = {"plain": partial(batch_plain, batch_size)}
                    runs |= {name: partial(batch_run, k, batch_size, ctrl) for name, ctrl in ctrls.items()}
                    runs["forced_on"] = partial(batch_run, k, batch_size, None)
                for name, value in _interleaved(r, runs).items():
                    tps.setdefault(name, []).append(value)
                for name, ctrl in ctrls.items():
                    for counter in COUNTERS:
                        counters[name][counter] += getattr(ctrl.counters, counter)

            def spread(values: list[float]) -> dict[str, float]:
                return {"median": statistics.median(values), "min": min(values), "max": max(values)}

            best = [max(p, f) for p, f in zip(tps["plain"], tps["forced_on"])]
            out: dict[str, object] = {
                "model": args.model,
                "regime": args.regime,
                "path": path,
                "batch_size": batch_size,
                "k": k,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "on_over_off": spread([a / b for a, b in zip(tps["horizon_on"], tps["horizon_off"])]),
                "forced_on_over_plain": spread([a / b for a, b in zip(tps["forced_on"], tps["plain"])]),
            }
            for name in configs:
                out[f"{name}_over_plain"] = spread([a / b for a, b in zip(tps[name], tps["plain"])])
                out[f"{name}_over_best"] = spread([a / b for a, b in zip(tps[name], best)])
                out[f"{name}_counters"] = counters[name]
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
