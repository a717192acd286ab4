"""A bounded soak of `melix-fsm serve` (opt-in; nothing here is a test).

One server in this process on a loopback ephemeral port (embedded checkpoint, policy
forced on), hammered for `--duration` seconds by `--clients` threads, each drawing at
random: a greedy completion whose answer must equal the one computed alone at start
(exact answers under load), a streamed completion cut off after a few chunks (a
disconnect), a chat completion, and bad requests that must be refused with a 4xx in the
one error shape (out-of-vocabulary logit_bias, invalid JSON, n = 2, an empty prompt, a
text/plain body, an oversized body). Reported (JSON on stdout, also --out): requests by
kind, unexpected answers (wrong status, wrong shape, mismatched text), latency p50/p99
of the completions, the process's RSS at start and end, and the server's own request
counters by final state. Exit 1 when anything was unexpected.

    python benchmarks/soak_serve.py --duration 600 --clients 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BODY_LIMIT = 64 << 10
PROMPTS = ["The king of", "Once upon a time there", "In the morning the", "She said that", "A small"]
BAD = [
    (b'{"prompt": "hi", "logit_bias": {"99999999": 5.0}}', "application/json", 400),
    (b"{not json", "application/json", 400),
    (b'{"prompt": "hi", "n": 2}', "application/json", 400),
    (b'{"prompt": ""}', "application/json", 400),
    (b'{"prompt": "hi"}', "text/plain", 415),
    (b'{"prompt": "' + b"a" * (100 << 10) + b'"}', "application/json", 413),  # over BODY_LIMIT
]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def post(
    port: int, body: bytes, kind: str = "application/json", path: str = "/v1/completions"
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": kind})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def complete(port: int, prompt: str, max_tokens: int) -> tuple[int, dict[str, Any]]:
    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, body = post(port, json.dumps(request).encode())
    return status, json.loads(body)


def cut_stream(port: int, prompt: str, chunks: int) -> bool:
    """A stream the client abandons after `chunks` events; True if it began as a 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": 400, "stream": True}).encode()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        seen = 0
        while seen < chunks:
            line = response.fp.readline()
            if not line:
                break
            seen += line.startswith(b"data: ")
        return response.status == 200
    finally:
        conn.close()


class Soak:
    def __init__(self, port: int, reference: dict[str, str], max_tokens: int) -> None:
        self.port, self.reference, self.max_tokens = port, reference, max_tokens
        self.counts: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def note(self, kind: str, problem: str | None = None, latency: float | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if problem:
                self.unexpected.append(f"{kind}: {problem}"[:300])
            if latency is not None:
                self.latencies.append(latency)

    def one(self, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.5:
            prompt = rng.choice(PROMPTS)
            began = time.perf_counter()
            status, body = complete(self.port, prompt, self.max_tokens)
            text = body.get("choices", [{}])[0].get("text") if status == 200 else None
            problem = None if text == self.reference[prompt] else f"status {status}, text {text!r}"
            self.note("complete", problem, time.perf_counter() - began)
        elif roll < 0.7:
            ok = cut_stream(self.port, rng.choice(PROMPTS), rng.randint(0, 4))
            self.note("cancelled_stream", None if ok else "stream did not start")
        elif roll < 0.8:
            messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
            body = json.dumps({"messages": messages, "max_tokens": 8}).encode()
            status, _ = post(self.port, body, path="/v1/chat/completions")
            self.note("chat", None if status == 200 else f"status {status}")
        else:
            body, kind, want = rng.choice(BAD)
            status, reply = post(self.port, body, kind)
            try:
                shaped = set(json.loads(reply)["error"]) == {"message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                shaped = False
            self.note("bad", None if status == want and shaped else f"status {status} (want {want})")

    def run(self, clients: int, duration: float, seed: int) -> None:
        deadline = time.monotonic() + duration

        def client(i: int) -> None:
            rng = random.Random(seed + i)
            while time.monotonic() < deadline:
                try:
                    self.one(rng)
                except Exception as exc:  # a refused connection or a timeout: unexpected
                    self.note("exception", f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + 300)


def server_counts(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("melix_requests_total{"):
            name, value = line.rsplit(" ", 1)
            out[name.split('"')[1]] = float(value)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "adapters")]
    from melix_mlx.serve.app import start_server
    from melix_mlx.serve.limits import ServeLimits
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(None, 2, "force_on")
    running = start_server(served, max_batch_size=args.clients, limits=ServeLimits(max_body_bytes=BODY_LIMIT))
    port = int(running.url.rsplit(":", 1)[1])
    reference = {q: complete(port, q, args.max_tokens)[1]["choices"][0]["text"] for q in PROMPTS}
    rss_start = rss_mb()
    soak = Soak(port, reference, args.max_tokens)
    began = time.monotonic()
    soak.run(args.clients, args.duration, args.seed)
    lat = sorted(soak.latencies)
    report = {
        "duration_s": round(time.monotonic() - began, 1),
        "clients": args.clients,
        "requests": dict(soak.counts),
        "unexpected": len(soak.unexpected),
        "unexpected_examples": soak.unexpected[:10],
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "rss_start_mb": round(rss_start, 1),
        "rss_end_mb": round(rss_mb(), 1),
        "server_requests_by_state": server_counts(port),
    }
    running.stop()
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    sys.stderr.flush()
    os._exit(1 if soak.unexpected else 0)  # mlx can abort in interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
