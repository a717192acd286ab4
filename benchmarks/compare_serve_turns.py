"""`bench_serve.py` with the server's turn of mlx-lm's loop chosen: `--turn step` (as shipped: one
generator step per turn) or `--turn budget` (mlx-lm's own `TimeBudget`: steps for 0.5 s per turn,
the server before one step a turn). Everything else is the same code, so runs of the two,
interleaved, say what one step a turn costs in throughput. Nothing here is a test.

    for turn in step budget budget step step budget; do
        python benchmarks/compare_serve_turns.py --turn $turn --results /tmp/turns/$turn-$RANDOM \\
            -- --concurrency 1 4 8 --repeats 1 --max-tokens 32 --per-workload 1
    done

Results of such a run: benchmarks/results/serve/compare-turns-c148.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def use_mlx_lm_turn() -> None:
    """Give the serving generator mlx-lm's TimeBudget back (one per generator)."""
    from melix_mlx.serve import runtime
    from mlx_lm.server import TimeBudget

    def budget(self: Any) -> Any:
        return self.__dict__.setdefault("_mlx_lm_budget", TimeBudget())

    runtime.ServingResponseGenerator._time_budget = property(budget, lambda self, value: None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turn", choices=["step", "budget"], required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="after --: bench_serve.py's options")
    args = parser.parse_args()
    if args.turn == "budget":
        use_mlx_lm_turn()
    import bench_serve

    rest = [a for a in args.rest if a != "--"]
    sys.argv = ["bench_serve.py", *rest, "--results", args.results]
    return bench_serve.main()


if __name__ == "__main__":
    sys.exit(main())
