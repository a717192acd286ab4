"""`melix-fsm serve` against mlx-lm's own server: tokens/s and time to first token.

Both servers run in this process on ephemeral ports over the same loaded checkpoint
(ours: MTPBatchGenerator, policy forced on at depth k; mlx-lm's: its ResponseGenerator
with plain mlx_lm.load). For each concurrency C, C client threads stream greedy
completions of held-out prompts (melix_mlx.tools.workloads), 2 requests per client; a cell is
run on both servers back to back, in alternating order across repeats, and the ratio of
the two is taken per repeat. Reported per server: aggregate completion tokens/s (all
completion tokens over the cell's wall time) and the median time to first token
(request sent -> first streamed text). Every request's prompt starts with its own line,
so no request is served from the prompt cache. Nothing here is a test.

    python benchmarks/bench_serve.py --regime both --concurrency 1 2 4 8 --repeats 3

`--regime openblas` re-runs this script in a child with Debian's OpenBLAS preloaded
(one thread), `reference` with LD_PRELOAD cleared, `both` runs the two children in turn.
Results: benchmarks/results/serve/bench-<regime>.json and .md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
RESULTS = ROOT / "benchmarks" / "results" / "serve"


def stream_one(port: int, prompt: str, max_tokens: int, timeout: float = 300.0) -> tuple[float, int, float]:
    """(seconds to first text, completion tokens, total seconds) of one streamed completion."""
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if first is None and data.get("choices") and data["choices"][0].get("text"):
                first = time.perf_counter() - start
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    finally:
        conn.close()
    return (first if first is not None else float("nan")), tokens, time.perf_counter() - start


def run_cell(port: int, prompts: list[str], concurrency: int, max_tokens: int, repeat: int) -> dict:
    results: list[tuple[float, int, float]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(2):
            # a first line no other request shares: no prompt-cache hits, every prompt prefilled
            prompt = f"# request {concurrency}-{repeat}-{i}-{j}\n" + prompts[(2 * i + j) % len(prompts)]
            out = stream_one(port, prompt, max_tokens)
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    tokens = sum(r[1] for r in results)
    return {"tok_s": tokens / wall, "ttft_s": statistics.median(r[0] for r in results), "tokens": tokens}


def start_mlx_lm(settings: Any) -> tuple[int, Any]:
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator

    generator = ResponseGenerator(ModelProvider(settings), LRUPromptCache(settings.prompt_cache_size))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: APIHandler(generator, *a, **k))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()

    return httpd.server_address[1], stop


def measure(args: argparse.Namespace, regime: str) -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm
    from melix_mlx.serve.app import mlx_settings, start_server
    from melix_mlx.serve.provider import load_served_model
    from melix_mlx.tools.workloads import held_out_prompts

    served = load_served_model(args.model, args.k, "force_on")
    prompts = [p.text for p in held_out_prompts(served.path, per_workload=args.per_workload)]
    if args.prompt_chars > 0:  # a realistic-size model prefills ~20 tokens/s on a CPU
        prompts = [text[: args.prompt_chars] for text in prompts]
    ours = start_server(served, max_batch_size=max(args.concurrency))
    theirs_port, stop_theirs = start_mlx_lm(mlx_settings(served, max_batch_size=max(args.concurrency)))
    ours_port = int(ours.url.rstrip("/").rsplit(":", 1)[1])
    stream_one(ours_port, prompts[0], 8)  # warm both
    stream_one(theirs_port, prompts[0], 8)
    cells = []
    try:
        for c in args.concurrency:
            runs = []
            for r in range(args.repeats):
                order = [("mtp", ours_port), ("mlx_lm", theirs_port)]
                if r % 2:
                    order.reverse()
                run = {name: run_cell(port, prompts, c, args.max_tokens, r) for name, port in order}
                runs.append(run)
                print(f"[{regime}] C={c} repeat {r}: {json.dumps(run)}", file=sys.stderr, flush=True)
            cells.append({"concurrency": c, "runs": runs})
    finally:
        ours.stop()
        stop_theirs()
    return {
        "regime": regime,
        "model": str(served.path),
        "k": served.num_draft_tokens,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "prompt_chars": args.prompt_chars,
        "repeats": args.repeats,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "cells": cells,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"Regime `{result['regime']}`; {result['model']}; k={result['k']}; {result['max_tokens']} tokens per "
        f"request; {result['prompts']} held-out prompts; median of {result['repeats']} (spread: min-max of "
        "the per-repeat ratios); mlx "
        f"{result['mlx']}, mlx-lm {result['mlx_lm']}, {result['machine']}.",
        "",
        "| C | MTP tok/s | mlx-lm tok/s | ratio | spread | MTP TTFT s | mlx-lm TTFT s | TTFT ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        runs = cell["runs"]
        ratios = [r["mtp"]["tok_s"] / r["mlx_lm"]["tok_s"] for r in runs]
        ttft = [r["mtp"]["ttft_s"] / r["mlx_lm"]["ttft_s"] for r in runs]

        def med(name: str, key: str, runs: list = runs) -> float:
            return statistics.median(r[name][key] for r in runs)

        lines.append(
            f"| {cell['concurrency']} | {med('mtp', 'tok_s'):.0f} | {med('mlx_lm', 'tok_s'):.0f} | "
            f"**{statistics.median(ratios):.2f}** | {min(ratios):.2f}-{max(ratios):.2f} | "
            f"{med('mtp', 'ttft_s'):.2f} | {med('mlx_lm', 'ttft_s'):.2f} | {statistics.median(ttft):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir or embedded alias (default stdlib-tiny)")
    p.add_argument("--k", type=int, default=1, help="draft depth (policy forced on)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-workload", type=int, default=2)
    p.add_argument("--prompt-chars", type=int, default=0, help="cut each prompt to N characters (0: whole)")
    p.add_argument("--regime", choices=["current", "reference", "openblas", "both"], default="current")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the .json and .md go")
    args = p.parse_args()
    if args.regime in ("reference", "openblas", "both"):
        regimes = ["reference", "openblas"] if args.regime == "both" else [args.regime]
        for regime in regimes:
            env = dict(os.environ)
            env.pop("LD_PRELOAD", None)
            if regime == "openblas":
                env.update(LD_PRELOAD=OPENBLAS, OPENBLAS_NUM_THREADS="1")
            argv = [a for a in sys.argv[1:]]
            i = argv.index("--regime")
            argv[i + 1] = "current"
            env["MELIX_SERVE_BENCH_REGIME"] = regime
            subprocess.run([sys.executable, __file__, *argv], env=env, check=True)
        return 0
    regime = os.environ.get("MELIX_SERVE_BENCH_REGIME", "current")
    result = measure(args, regime)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"bench-{regime}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (args.results / f"bench-{regime}.md").write_text(text)
    print(text, flush=True)
    sys.stderr.flush()
    # mlx's runtime can abort during interpreter teardown after server threads used it
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
