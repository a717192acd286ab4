"""`melix-fsm serve --sharding tensor` on 2 loopback ranks against one process: tokens/s.

Both servers are the same command line (stdlib-hybrid, MTP forced on, k = 2); the sharded
one runs under `mlx.launch --backend ring -n 2` on 127.0.0.1 (tests/adapters/sharded_server.py).
The two are started in turn, never together (an idle sharded server still turns every
0.1 s and `mlx.launch` polls its ranks), `--pairs` times: single, sharded, single, ...
Each start answers one warm-up request, then `--rounds` rounds of 4 concurrent greedy
completions of `--max-tokens` tokens; a round's figure is its completion tokens over its
wall time. Reported: each server's median and range over all rounds, and the ratio of the
medians (sharded / single). Loopback shows the cost of the protocol and of two ranks on
the same cores, not a link (docs/distributed.md). Nothing here is a test.

    python benchmarks/bench_serve_sharded.py --pairs 3 --rounds 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "adapters"))

from serve_helpers import client  # noqa: E402
from sharded_server import ShardedServer, free_port  # noqa: E402

PROMPTS = ["def parse_args(argv):", "import os", "class Parser:", "for i in range("]
SERVE = ("--model", "stdlib-hybrid", "--device-policy", "force_on", "--num-draft-tokens", "2")
READY_S = 180.0


def measure(url: str, rounds: int, max_tokens: int) -> list[float]:
    """Completion tokens/s of each round of 4 concurrent greedy requests."""
    c = client(url)
    c.completions.create(model="stdlib-hybrid", prompt="warm up", max_tokens=8, temperature=0)

    def ask(prompt: str) -> int:
        r = c.completions.create(model="stdlib-hybrid", prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.usage.completion_tokens

    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            tokens = sum(pool.map(ask, PROMPTS))
        rates.append(tokens / (time.perf_counter() - start))
    return rates


def single(rounds: int, max_tokens: int) -> list[float]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "adapters")]))
    command = [sys.executable, "-m", "melix_fsm.cli", "serve", "--port", str(port), *SERVE]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            try:
                client(url).models.list()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the single-process server did not start") from None
                time.sleep(0.2)
        return measure(url, rounds, max_tokens)
    finally:
        proc.kill()
        proc.wait()


def sharded(rounds: int, max_tokens: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="melix-bench-sharded-") as tmp:
        server = ShardedServer(Path(tmp), "--sharding", "tensor", *SERVE)
        try:
            server.wait_ready(READY_S)
            return measure(server.url, rounds, max_tokens)
        finally:
            server.close()


def summary(rates: dict[str, list[float]]) -> dict[str, Any]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "tokens_per_s": {
            name: {"median": round(medians[name], 1), "min": round(min(v), 1), "max": round(max(v), 1)}
            for name, v in rates.items()
        },
        "ratio_sharded_over_single": round(medians["sharded"] / medians["single"], 3),
        "rounds": {name: [round(x, 1) for x in v] for name, v in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"single": [], "sharded": []}
    for _ in range(args.pairs):
        rates["single"] += single(args.rounds, args.max_tokens)
        rates["sharded"] += sharded(args.rounds, args.max_tokens)
        print(json.dumps(rates), file=sys.stderr, flush=True)
    print(json.dumps(summary(rates), indent=1))


if __name__ == "__main__":
    main()
