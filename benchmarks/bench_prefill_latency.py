"""Latency under a long prefill: short streams beside a ~20,000-token prompt (opt-in).

Starts the real server as a subprocess (`melix-fsm serve`, the embedded default
checkpoint unless `--model`), with the context and prompt limits raised by flag so that
a prompt longer than a tiny checkpoint's trained context is accepted. Then:

1. idle: the short streaming request alone, `--idle-repeats` times (each with its own
   first line, so the prompt cache never answers it): its time to first token (TTFT)
   and its gaps between tokens (one decode step: their p90, a cycle's tokens come in one
   burst);
2. loaded: the long prompt streams (one chat request, the chat template rendered by the
   server); once its prefill has begun (the server's prompt-token counter moves),
   `--clients` short streaming clients repeat the short request until the long prompt's
   first token, or until `--window` seconds (then the long prompt is cancelled, and the
   tokens it prefilled are reported). Scored: the short requests whose first token came
   inside that window, and their gaps inside it.

Reported (JSON, also `--out`): TTFT and gap percentiles (p50/p90/p99/max) idle and
loaded; the prefill segments the server timed during the loaded window (its
`melix_prefill_segment_seconds` histogram: count, mean, the bucket holding p50/p90/p99,
the longest); the same for the parts of a gap the server times (`step_parts`: each whole
generator step, each admission of joining prompts, the loop's work between two steps);
and the bounds checked, with the segment taken as the configured budget
(`--prefill-budget`) and as the longest segment measured:

    TTFT_loaded <= 2 x TTFT_idle(p50) + segment      (every scored request)
    token gap   <= 2 x TTFT_idle(p50) + segment      (the server's longest step + loop turn)

and, reported beside them, the clients' text gaps against `segment + decode step (idle
p90 gap)` and against the TTFT bound: a text event can hold several tokens (the
detokenizer holds a word's first tokens until it ends), so one text gap may span steps.
Exit 1 when a bound fails against the measured longest segment.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/bench_prefill_latency.py \\
        --out benchmarks/results/serve/prefill-latency-openblas.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHORT = "def parse_args(argv):\n    "
STARTUP_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(ordered[-1], 4)}


def stream(
    port: int, path: str, body: dict[str, Any], timeout: float = 7200.0, holder: dict | None = None
) -> dict[str, Any]:
    """One streamed request: its start, each content event's arrival, its end (monotonic s).
    `holder` gets the connection (another thread may cut it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if holder is not None:
        holder["conn"] = conn
    began = time.monotonic()
    arrivals: list[float] = []
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}: {response.read()[:200]!r}")
        for line in response.fp:
            if line.startswith(b": keepalive ") and holder is not None:  # prefill progress: done/total
                holder["progress"] = [int(n) for n in line.split()[-1].split(b"/")]
            if line.startswith(b"data: [DONE]"):
                break  # the stream's end: the connection itself stays open (keep-alive)
            if not line.startswith(b"data: "):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                arrivals.append(time.monotonic())
    finally:
        conn.close()
    return {"began": began, "arrivals": arrivals, "ended": time.monotonic()}


def short_body(tag: str, tokens: int) -> dict[str, Any]:
    return {"prompt": f"# {tag}\n{SHORT}", "max_tokens": tokens, "temperature": 0, "stream": True}


def scored(run: dict[str, Any]) -> tuple[float | None, list[float]]:
    arrivals = run["arrivals"]
    if not arrivals:
        return None, []
    return arrivals[0] - run["began"], [b - a for a, b in zip(arrivals, arrivals[1:])]


def metrics(port: int) -> dict[str, float]:
    """The server's /metrics (started without an API key here)."""
    from soak_serve import metrics as scrape  # beside this script: one /metrics reader

    return scrape(port, key=None)


def duration_stats(before: dict[str, float], after: dict[str, float], name: str) -> dict[str, Any]:
    """The durations one of the server's histograms timed between two scrapes."""
    prefix = f'{name}_bucket{{le="'
    buckets = sorted(
        (float(k[len(prefix) : -2]), after[k] - before.get(k, 0.0)) for k in after if k.startswith(prefix)
    )
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)

    def bucket(q: float) -> float | None:  # the upper edge of the bucket holding quantile q
        for edge, cumulative in buckets:
            if count and cumulative >= q * count:
                return edge
        return None

    return {
        "count": int(count),
        "mean_s": round(total / count, 4) if count else None,
        "p50_bucket_le_s": bucket(0.5),
        "p90_bucket_le_s": bucket(0.9),
        "p99_bucket_le_s": bucket(0.99),
        "max_s_since_start": round(after.get(f"{name}_max", float("nan")), 4),
    }


def long_prompt(checkpoint: Path, tokens: int) -> tuple[str, int]:
    """Python source from the standard library (the embedded models' domain), ~`tokens` long."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    lib = Path(os.__file__).parent
    text, count = "", 0
    for path in sorted(lib.glob("*.py")):
        piece = path.read_text(errors="ignore")
        n = len(tokenizer.encode(piece).ids)
        if count + n > tokens:
            ids = tokenizer.encode(piece).ids[: tokens - count]
            text += tokenizer.decode(ids)
            break
        text, count = text + piece, count + n
    return text, len(tokenizer.encode(text).ids)


def serve(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    exe = shutil.which("melix-fsm") or str(Path(sys.executable).parent / "melix-fsm")
    command = [
        exe,
        "serve",
        "--port",
        str(port),
        "--max-batch-size",
        str(args.clients + 2),
        "--context-length",
        str(args.long_tokens + 4096),
        "--max-prompt-tokens",
        str(args.long_tokens + 2048),
        "--max-body-bytes",
        str(8 << 20),
        "--request-timeout",
        "3600",
        "--prefill-budget",
        str(args.prefill_budget),
    ]
    if args.model:
        command += ["--model", args.model]
    args.server_command = " ".join(command[1:])
    handle = log.open("w")
    process = subprocess.Popen(command, stdout=handle, stderr=handle)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return process
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start")


def measure(args: argparse.Namespace, port: int, checkpoint: Path) -> dict[str, Any]:
    text, counted = long_prompt(checkpoint, args.long_tokens)
    stream(port, "/v1/completions", short_body("warm-up", args.short_tokens))
    idle = [
        stream(port, "/v1/completions", short_body(f"idle {i}", args.short_tokens))
        for i in range(args.idle_repeats)
    ]
    idle_ttft = [scored(r)[0] for r in idle if scored(r)[0] is not None]
    idle_gaps = [g for r in idle for g in scored(r)[1]]
    before = metrics(port)
    long_run: dict[str, Any] = {"began": time.monotonic()}
    holder: dict[str, Any] = {}

    def long_client() -> None:
        body = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            long_run.update(stream(port, "/v1/chat/completions", body, holder=holder))
        except OSError as exc:  # cut at the window's end
            long_run.update(ended=time.monotonic(), arrivals=[], cut=f"{type(exc).__name__}")

    thread = threading.Thread(target=long_client, daemon=True)
    thread.start()
    while metrics(port).get("melix_prompt_tokens_total", 0.0) == before.get("melix_prompt_tokens_total", 0.0):
        time.sleep(0.05)  # the long prompt's prefill has not begun
    prefill_seen = time.monotonic()
    runs: list[dict[str, Any]] = []
    lock = threading.Lock()

    def short_client(i: int) -> None:
        j = 0
        while thread.is_alive():
            run = stream(port, "/v1/completions", short_body(f"client {i} request {j}", args.short_tokens))
            with lock:
                runs.append(run)
            j += 1

    shorts = [threading.Thread(target=short_client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in shorts:
        t.start()
    thread.join(args.window)
    window_cut = thread.is_alive()
    after = metrics(port)
    progress = holder.get("progress")  # the long prompt's tokens prefilled when the window ended
    if window_cut:  # the window ended first: the long prompt is cancelled (a disconnect)
        with contextlib.suppress(OSError):
            holder["conn"].sock.shutdown(socket.SHUT_RDWR)
        thread.join(120)
    for t in shorts:
        t.join(600)
    first = long_run["arrivals"][0] if long_run.get("arrivals") else long_run["ended"]
    if window_cut:
        first = min(first, long_run["began"] + args.window)
    # scored: what happened while the long prompt prefilled (its first token ends that)
    inside = [r for r in runs if r["arrivals"] and r["arrivals"][0] <= first]
    ttft = [scored(r)[0] for r in inside]
    gaps = [b - a for r in inside for a, b in zip(r["arrivals"], r["arrivals"][1:]) if b <= first]
    # one decode step: the idle p90 gap (a cycle emits its accepted drafts in one burst: the
    # median gap is ~0 between the tokens of one cycle)
    idle_p50, step = percentiles(idle_ttft)["p50"], percentiles(idle_gaps)["p90"]
    segments = duration_stats(before, after, "melix_prefill_segment_seconds")
    # where the gaps go (the server's own clocks): whole steps, admissions, the loop between steps
    parts = {
        part: duration_stats(before, after, f"melix_{part}_seconds")
        for part in ("step", "admission", "between_steps")
    }
    checks = {}
    longest = segments["max_s_since_start"]
    # a token's gap as the server sees it: one step and the loop's work after it; a client's
    # text gap can span more (the detokenizer holds a word's first tokens until the word ends)
    token_gap = parts["step"]["max_s_since_start"] + parts["between_steps"]["max_s_since_start"]
    for name, segment in (("budget", args.prefill_budget), ("longest_measured", longest)):
        ttft_bound = 2 * idle_p50 + segment
        gap_bound = segment + step
        checks[name] = {
            "segment_s": segment,
            "ttft_bound_s": round(ttft_bound, 4),
            "ttft_over_bound": sum(t > ttft_bound for t in ttft),
            "longest_token_gap_s": round(token_gap, 4),
            "token_gaps_hold": token_gap <= ttft_bound,  # the same bound as a first token's
            "gap_bound_s": round(gap_bound, 4),
            "text_gaps_over_gap_bound": sum(g > gap_bound for g in gaps),
            "text_gaps_over_ttft_bound": sum(g > ttft_bound for g in gaps),
            "holds": bool(ttft) and all(t <= ttft_bound for t in ttft) and token_gap <= ttft_bound,
        }
    return {
        "long_prompt_tokens": counted,
        "long_prefill_s": None if window_cut else round(first - long_run["began"], 2),
        "window_s": round(first - long_run["began"], 2),
        "window_cut_the_long_prompt": window_cut,
        "long_prompt_prefilled_at_window_end": progress,
        "prompt_tokens_prefilled_in_window_all_requests": int(
            after.get("melix_prompt_tokens_total", 0.0) - before.get("melix_prompt_tokens_total", 0.0)
        ),
        "long_prefill_seen_after_s": round(prefill_seen - long_run["began"], 3),
        "short_tokens": args.short_tokens,
        "clients": args.clients,
        "idle": {"ttft_s": percentiles(idle_ttft), "gap_s": percentiles(idle_gaps)},
        "loaded": {
            "requests_scored": len(inside),
            "requests_outside_prefill": len(runs) - len(inside),
            "gaps_scored": len(gaps),
            "ttft_s": percentiles(ttft),
            "gap_s": percentiles(gaps),
        },
        "segments": segments,
        "step_parts": parts,
        "decode_step_s": step,
        "checks": checks,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the server's embedded default)")
    p.add_argument("--long-tokens", type=int, default=20000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=12)
    p.add_argument("--idle-repeats", type=int, default=8)
    p.add_argument("--prefill-budget", type=float, default=0.25)
    p.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds to score at most; then the long prompt is cancelled (default: its prefill)",
    )
    p.add_argument("--regime", default=None, help="what to record as the BLAS regime (default: from the env)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "adapters")]
    from melix_mlx.loading.checkpoints import DEFAULT, resolve_model

    checkpoint = resolve_model(args.model or DEFAULT)
    port = free_port()
    log = Path(f"/tmp/bench_prefill_latency_{port}.log")
    process = serve(args, port, log)
    try:
        result = measure(args, port, checkpoint)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    regime = args.regime or (
        "openblas-1-thread" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference-blas"
    )
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "server_command": "melix-fsm " + args.server_command,
        "regime": regime,
        "env": {k: os.environ[k] for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") if k in os.environ},
        "machine": f"{os.cpu_count()} cpus, shared with other engineers' work (contended)",
        "load_average": os.getloadavg(),
        "model": checkpoint.name,
        **result,
    }
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if result["checks"]["longest_measured"]["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
