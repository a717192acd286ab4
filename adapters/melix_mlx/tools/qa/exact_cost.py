"""What a decode-shaped verify would cost: k+1 rows as one matmul against k+1 one-row matmuls.

Run `python -m melix_mlx.tools.qa.exact_cost [--dim D]`; docs/conformance.md ("Exact
verify: not built") quotes its output. Rules:
- One linear layer of D x D weights (float16, and 4-bit, group 64) on this device; the
  verify's rows as one [1, k+1, D] product against k+1 products of one row each (what a
  verify reproducing the decode kernel per position would run), and one decode row.
- Also reports whether the split result is bit-equal to the batched one here (it is on
  the CPU wheel; on a GPU the row count picks the kernel, which is the whole point).
- Timings are means of 30 evaluations after 3 warm-ups; on a shared machine read ratios.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn


def _mean_seconds(fn: Callable[[], mx.array], n: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4096)
    d = parser.parse_args().dim
    for kind in ("float16", "q4"):
        layer: nn.Module = nn.Linear(d, d, bias=False)
        if kind == "q4":
            layer = nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4)
        else:
            layer.set_dtype(mx.float16)
        mx.eval(layer.parameters())
        for rows in (3, 4):
            print(f"{kind} {d}x{d}, k+1 = {rows}: " + _row(layer, rows, d))


def _row(layer: nn.Module, rows: int, d: int) -> str:
    x = mx.random.normal((1, rows, d)).astype(mx.float16)

    def split() -> mx.array:
        return mx.concatenate([layer(x[:, i : i + 1]) for i in range(rows)], axis=1)

    one = _mean_seconds(lambda: layer(x))
    apart = _mean_seconds(split)
    decode = _mean_seconds(lambda: layer(x[:, :1]))
    same = mx.array_equal(layer(x), split()).item()
    return (
        f"one {rows}-row matmul {one * 1e3:.2f} ms, {rows} one-row matmuls {apart * 1e3:.2f} ms "
        f"({apart / one:.2f}x), one decode row {decode * 1e3:.2f} ms; bit-equal here: {same}"
    )


if __name__ == "__main__":
    main()
