"""The library's `num_draft_tokens="auto"` against plain mlx-lm and against `melix-fsm generate`.

One process loads the model once, then runs these modes interleaved, round after round,
on the same prompts: plain (mlx-lm's `stream_generate`), plain again (the A/A noise),
library auto (`mtp_stream_generate(..., num_draft_tokens="auto")`) and library forced on
(`device_policy="force_on"` at depth 2). Each figure is mlx-lm's own `generation_tps` of
the run's last response, so prefill is not counted. The CLI (`melix-fsm generate
--num-draft-tokens auto --json`) runs in a subprocess per prompt and round, and its
`generation_tps` is read from the JSON. The first auto call is timed apart: it
calibrates, or reuses the cached calibration. The report gives medians over rounds and
prompts, ratios against plain, the A/A ratio, and auto's receipt (gate, reason,
predicted speedup, where the timings came from).

Run it under a BLAS regime (DESIGN.md), for example:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \
    python benchmarks/bench_library_auto.py --model stdlib-hybrid
  python benchmarks/bench_library_auto.py --model stdlib-hybrid      # the wheel's reference BLAS
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPTS = ["import os\n", "def parse_args(argv):", "class Config:"]


def _last(responses):
    return list(responses)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="stdlib-hybrid")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    ap.add_argument("--cli", action="store_true", help="also run `melix-fsm generate` (a subprocess per run)")
    args = ap.parse_args()

    from melix_mlx.generate import mtp_stream_generate
    from melix_mlx.loading import load_with_heads
    from mlx_lm.generate import stream_generate

    model, tokenizer, head, _ = load_with_heads(args.model)
    n = args.max_tokens

    def plain(p):
        return _last(stream_generate(model, tokenizer, p, max_tokens=n))

    def auto(p):
        return _last(mtp_stream_generate(model, tokenizer, p, head, max_tokens=n, num_draft_tokens="auto"))

    def forced(p):
        return _last(
            mtp_stream_generate(
                model, tokenizer, p, head, max_tokens=n, num_draft_tokens=2, device_policy="force_on"
            )
        )

    tic = time.perf_counter()
    first = auto(PROMPTS[0])
    first_s = time.perf_counter() - tic
    modes = {"plain": plain, "plain_aa": plain, "auto": auto, "force_on_k2": forced}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    receipts, proposed = [], []
    for _ in range(args.rounds):
        for p in PROMPTS[: args.prompts]:
            for name, fn in modes.items():
                r = fn(p)
                rates[name].append(r.generation_tps)
                if name == "auto":
                    receipts.append(r.receipt)
                    proposed.append(r.stats.proposed)
            if args.cli:
                cmd = [sys.executable, "-m", "melix_fsm.cli", "generate", "--model", args.model]
                cmd += ["--prompt", p, "--max-tokens", str(n), "--num-draft-tokens", "auto", "--json"]
                out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=600)
                if out.returncode == 0:
                    rates.setdefault("cli_auto", []).append(json.loads(out.stdout)["generation_tps"])
    med = {m: statistics.median(v) for m, v in rates.items()}
    last = receipts[-1]
    hw = last.hardware
    report = {
        "model": args.model,
        "blas": os.environ.get("LD_PRELOAD", "reference (mlx wheel)"),
        "threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "max_tokens": n,
        "runs_per_mode": len(rates["plain"]),
        "median_tps": {m: round(v, 1) for m, v in med.items()},
        "vs_plain": {m: round(v / med["plain"], 3) for m, v in med.items()},
        "per_run_tps": {m: [round(x, 1) for x in v] for m, v in rates.items()},
        "first_auto_call_s": round(first_s, 2),
        "first_auto_detail": first.receipt.hardware.detail if first.receipt.hardware else None,
        "auto_receipt": {
            "gate": str(last.hardware_gate),
            "refusal_reason": str(last.refusal_reason),
            "message": last.message,
            "predicted_speedup": hw.predicted_speedup if hw else None,
            "regime": str(hw.measured_regime) if hw else None,
            "t_1_ms": hw.t_1 * 1e3 if hw and hw.t_1 else None,
            "t_verify_ms": hw.t_verify * 1e3 if hw and hw.t_verify else None,
            "detail": hw.detail if hw else None,
        },
        "auto_drafts_proposed": proposed,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
