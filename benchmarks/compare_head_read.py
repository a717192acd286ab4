"""The head read at one slot against the whole trunk read after, in one process, interleaved.

`new` is the engine as shipped (`head.at_slot`: the block's MLP at the read slot only);
`old` swaps in the previous read (the trunk at every slot, then the slot taken). Both run
MTPBatchGenerator (k = 2, greedy) over the same four prompts at batch 1 and 4, order
alternating per repeat; reported: wall seconds per run (prefill included) and the median
ratio new / old. Nothing here is a test.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/compare_head_read.py stdlib-tiny stdlib-hybrid
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import melix_mlx.runtime.engine as engine
import mlx.core as mx
from melix_mlx.decoding.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime.engine_head import head_at

TEXTS = [
    "def parse_args(argv):\n",
    "class Node:\n    def __init__(self",
    "import os\nimport sys\n\ndef main",
    "for i in range(10):\n    ",
]


def whole_then_read(head: Any, hidden: mx.array, tokens: mx.array, cache: list[Any], at: mx.array) -> Any:
    """The read before `at_slot`: the trunk at every slot, then the slot taken."""
    index = at.astype(mx.int32).reshape(-1, 1, 1)
    out = mx.take_along_axis(head.trunk(hidden, tokens, cache), index, axis=1)
    return head.logits(out)[:, 0], out


def run(model: Any, head: Any, prompts: list[list[int]], tokens: int, read: Any) -> float:
    """Wall seconds of one MTPBatchGenerator run over `prompts` with the engine's head read `read`."""
    engine.head_at = read
    gen = MTPBatchGenerator(
        model,
        head,
        num_draft_tokens=2,
        max_tokens=tokens,
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
    )
    start = time.perf_counter()
    gen.insert(prompts, max_tokens=[tokens] * len(prompts))
    while gen.next_generated():
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for name in args.models:
        model, tok, head, _ = load_with_heads(str(resolve_model(name)))
        prompts = [tok.encode(t) for t in TEXTS]

        times: dict[str, list[float]] = {}
        reads = [("old", whole_then_read), ("new", head_at)]
        for repeat in range(args.repeats):
            for side, read in reads if repeat % 2 == 0 else reads[::-1]:
                for batch in (1, 4):
                    times.setdefault(f"{side} B={batch}", []).append(
                        run(model, head, prompts[:batch], args.tokens, read)
                    )
        engine.head_at = head_at
        report[name] = {
            **{key: [round(t, 4) for t in values] for key, values in times.items()},
            **{
                f"new/old B={b}": round(
                    statistics.median(times[f"new B={b}"]) / statistics.median(times[f"old B={b}"]), 3
                )
                for b in (1, 4)
            },
        }
        print(name, {k: v for k, v in report[name].items() if k.startswith("new/old")}, flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
