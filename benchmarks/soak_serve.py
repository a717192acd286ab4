"""A soak of `melix-fsm serve`: both APIs, tools, seeds, cancellations, bad input (opt-in).

The server runs as a subprocess (`melix-fsm serve`, the embedded default checkpoint
unless `--model`, MTP forced on, an API key), so its RSS is its own. First every request
the soak will check is answered alone, one at a time, against that same server: those are
the solo answers. Then `--clients` threads (16) draw kinds at random for `--minutes`:

- greedy completions, each compared with its solo answer: raw HTTP `/v1/completions`;
  the official `openai` client on `/v1/chat/completions`; the official `anthropic`
  client on `/v1/messages`; streamed or whole (a stream's text must equal the whole one);
- tool requests (the tools in the request; a tool call and its result round-tripped:
  OpenAI `tool_calls` and a `role: tool` message, Anthropic `tool_use` and
  `tool_result` blocks), on both clients, compared with their solo answers;
- seeded sampled completions (temperature 0.8, a `seed`), raw HTTP, streamed or whole,
  each equal to its solo answer with the same seed (the seeded stream is the request's
  own, whatever else is in the batch: docs/serving.md);
- cancellations: a stream its client leaves after a few events, on both APIs, raw and
  through both clients;
- bad input, whose refusal (status and error shape) is the expected answer: an
  out-of-vocabulary logit_bias, invalid JSON, n = 2, an empty prompt, a text/plain body,
  an oversized body, a missing key (401), Anthropic requests without max_tokens, with
  no messages, with `tool_choice` any.

Checked (`Tally`): every status is the expected one (unexpected: 0), every answer equals
its solo answer (mismatches: 0). Sampled every `--sample-s`: the server's RSS and its
prompt cache (entries and bytes against their bounds, from /metrics), and its memory by
layer (mlx's live arrays and cache, malloc's bytes in use and free bytes it holds, Python's
objects: melix_mlx.serve.memory), each with its slope. Reported (JSON,
also `--out`; a summary on stderr): requests by kind, latency p50/p99 by kind, the
unexpected and the mismatched (with examples), the RSS samples and their least-squares
slope after `--warmup-minutes` (MB/hour), the prompt cache's largest size against its
bound, the server's requests by final state. Exit 1 when anything was unexpected, an
answer mismatched, the cache exceeded its bound, or the slope is above `--max-slope`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/soak_serve.py --minutes 60 --sample-s 5 \\
        --out benchmarks/results/serve/soak-60min.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key"
MODEL = "stdlib-tiny"
BODY_LIMIT = 64 << 10
MAX_TOKENS = 16
PROMPTS = ["def main():", "class Parser:", "import os\n", "for i in range(", "def parse(text):"]
SEEDS = (1, 7, 42)
SYSTEM = "You write Python."
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find a name.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
ANTHROPIC_TOOL = {
    "name": "lookup",
    "description": "Find a name.",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
}
ERROR_KEYS = {"message", "type", "param", "code"}


# -- the checking logic (tests/adapters/test_serve_soak.py) --------------------------------------
def slope_per_hour(samples: list[tuple[float, float]], after_s: float = 0.0) -> float | None:
    """Least-squares slope of (seconds, value) samples taken at or after `after_s`, per hour."""
    kept = [(t, v) for t, v in samples if t >= after_s]
    if len(kept) < 3:
        return None
    n = len(kept)
    mt = sum(t for t, _ in kept) / n
    mv = sum(v for _, v in kept) / n
    var = sum((t - mt) ** 2 for t, _ in kept)
    if var == 0:
        return None
    return 3600.0 * sum((t - mt) * (v - mv) for t, v in kept) / var


def memory_slopes(samples: list[dict[str, float]], after_s: float) -> dict[str, float | None]:
    """Each memory series' slope after warm-up (MB/hour): which layer tracks the RSS."""
    out = {}
    for name in MEMORY:
        series = [(s["t"], s[name]) for s in samples if name in s]
        slope = slope_per_hour(series, after_s)
        out[name] = None if slope is None else round(slope, 2)
    return out


class Tally:
    """Counts by kind; unexpected statuses and mismatched answers, with examples."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.unexpected: list[str] = []
        self.mismatches: list[str] = []
        self.lock = threading.Lock()

    def done(self, kind: str, seconds: float | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if seconds is not None:
                self.latencies[kind].append(seconds)

    def status(self, kind: str, got: int, expected: int, detail: str = "") -> bool:
        if got == expected:
            return True
        with self.lock:
            self.unexpected.append(f"{kind}: status {got} (expected {expected}) {detail}"[:400])
        return False

    def same(self, kind: str, got: Any, solo: Any) -> bool:
        if got == solo:
            return True
        with self.lock:
            self.mismatches.append(f"{kind}: got {got!r}, solo {solo!r}"[:400])
        return False

    def failed(self, kind: str, exc: BaseException) -> None:
        with self.lock:
            self.unexpected.append(f"{kind}: {type(exc).__name__}: {exc}"[:400])

    def latency(self) -> dict[str, dict[str, float]]:
        out = {}
        for kind, values in sorted(self.latencies.items()):
            ordered = sorted(values)
            out[kind] = {
                "p50_s": round(ordered[len(ordered) // 2], 3),
                "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
            }
        return out


# -- raw HTTP -----------------------------------------------------------------------------------
def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        sent = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        sent.update(headers or {})
        conn.request("POST", path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def sse_text(payload: bytes) -> str:
    """The text of an OpenAI completions stream."""
    text = []
    for line in payload.splitlines():
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            text.append(choice.get("text") or "")
    return "".join(text)


def completion(port: int, prompt: str, stream: bool, **fields: Any) -> tuple[int, str | None]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream, **fields}
    status, payload = post(port, "/v1/completions", json.dumps(body).encode())
    if status != 200:
        return status, payload.decode(errors="replace")[:200]
    return status, sse_text(payload) if stream else json.loads(payload)["choices"][0]["text"]


def cut_raw(port: int, path: str, body: dict[str, Any], events: int) -> int:
    """A stream the client leaves after `events` data lines; its status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        headers = {"Content-Type": "application/json", "x-api-key": KEY}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        seen = 0
        while seen < events:
            line = response.fp.readline()
            if not line:
                break
            seen += line.startswith(b"data: ")
        return response.status
    finally:
        conn.close()


# -- the requests, as the clients send them -------------------------------------------------------
def openai_turns(prompt: str, tools: bool) -> list[dict[str, Any]]:
    if not tools:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    return [
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x = 1"},
        {"role": "user", "content": prompt},
    ]


def anthropic_turns(prompt: str, tools: bool) -> list[dict[str, Any]]:
    if not tools:
        return [{"role": "user", "content": prompt}]
    return [
        {"role": "user", "content": "Find x."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x = 1"},
                {"type": "text", "text": prompt},
            ],
        },
    ]


def openai_answer(client: Any, prompt: str, tools: bool, stream: bool) -> Any:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": openai_turns(prompt, tools),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if tools:
        fields["tools"] = [OPENAI_TOOL]
    if not stream:
        message = client.chat.completions.create(**fields).choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return message.content, calls
    text, calls = [], {}
    for chunk in client.chat.completions.create(**fields, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        text.append(delta.content or "")
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
    return "".join(text), [calls[i] for i in sorted(calls)]


def anthropic_answer(client: Any, prompt: str, tools: bool, stream: bool) -> Any:
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "messages": anthropic_turns(prompt, tools),
        "system": SYSTEM,
        "extra_body": {"temperature": 0},
    }
    if tools:
        fields.update(tools=[ANTHROPIC_TOOL], tool_choice={"type": "auto"})
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    blocks = [(b.type, getattr(b, "text", None) or getattr(b, "name", None)) for b in message.content]
    return blocks, message.stop_reason


def bad_requests() -> list[tuple[str, str, bytes, dict[str, str], int]]:
    """(name, path, body, headers, expected status)."""
    json_type = {"Content-Type": "application/json"}
    return [
        (
            "logit_bias",
            "/v1/completions",
            b'{"prompt": "hi", "logit_bias": {"99999999": 5.0}}',
            json_type,
            400,
        ),
        ("invalid_json", "/v1/completions", b"{not json", json_type, 400),
        ("n2", "/v1/completions", b'{"prompt": "hi", "n": 2}', json_type, 400),
        ("empty_prompt", "/v1/completions", b'{"prompt": ""}', json_type, 400),
        ("text_plain", "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, 415),
        (
            "oversized",
            "/v1/completions",
            b'{"prompt": "' + b"a" * (BODY_LIMIT + 1024) + b'"}',
            json_type,
            413,
        ),
        (
            "no_key",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            {**json_type, "Authorization": "Bearer wrong"},
            401,
        ),
        (
            "messages_no_max_tokens",
            "/v1/messages",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            json_type,
            400,
        ),
        (
            "messages_empty",
            "/v1/messages",
            json.dumps({"model": MODEL, "messages": [], "max_tokens": 4}).encode(),
            json_type,
            400,
        ),
        (
            "messages_tool_choice_any",
            "/v1/messages",
            json.dumps(
                {
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [ANTHROPIC_TOOL],
                    "tool_choice": {"type": "any"},
                }
            ).encode(),
            json_type,
            400,
        ),
    ]


def error_shaped(path: str, payload: bytes) -> bool:
    try:
        body = json.loads(payload)
        if path.startswith("/v1/messages"):
            return body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return set(body["error"]) == ERROR_KEYS
    except (ValueError, KeyError, TypeError):
        return False


# -- the soak -------------------------------------------------------------------------------------
class Soak:
    def __init__(self, port: int, tally: Tally) -> None:
        self.port, self.tally = port, tally
        self.solo: dict[tuple, Any] = {}
        self.bad = bad_requests()

    def clients(self) -> tuple[Any, Any]:
        import anthropic
        import openai

        url = f"http://127.0.0.1:{self.port}"
        return (
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=300, max_retries=0),
            anthropic.Anthropic(base_url=url, api_key=KEY, timeout=300, max_retries=0),
        )

    def answers(self, pair: tuple) -> dict[tuple, Callable[[bool], Any]]:
        """Every checked request, by key: a function of `stream` giving its answer through
        these clients (one pair per thread: no shared connection pool)."""
        oa, an = pair
        out: dict[tuple, Callable[[bool], Any]] = {}
        for p in PROMPTS:
            out[("completion", p)] = lambda s, p=p: completion(self.port, p, s, temperature=0)
            out[("openai_chat", p)] = lambda s, p=p: openai_answer(oa, p, False, s)
            out[("anthropic", p)] = lambda s, p=p: anthropic_answer(an, p, False, s)
            out[("openai_tools", p)] = lambda s, p=p: openai_answer(oa, p, True, s)
            out[("anthropic_tools", p)] = lambda s, p=p: anthropic_answer(an, p, True, s)
            for seed in SEEDS:
                out[("seeded", p, seed)] = lambda s, p=p, seed=seed: completion(
                    self.port, p, s, temperature=0.8, seed=seed
                )
        return out

    def measure_solo(self) -> None:
        for key, answer in self.answers(self.clients()).items():
            self.solo[key] = answer(False)
            if key[0] in ("completion", "seeded") and self.solo[key][0] != 200:
                raise RuntimeError(f"solo {key}: {self.solo[key]}")

    def one(self, rng: random.Random, answers: dict[tuple, Callable[[bool], Any]], clients: tuple) -> None:
        roll = rng.random()
        began = time.perf_counter()
        if roll < 0.55:  # a checked answer
            key = rng.choice(list(answers))
            stream = rng.random() < 0.5
            kind = f"{key[0]}_{'stream' if stream else 'whole'}"
            got = answers[key](stream)
            if key[0] in ("completion", "seeded") and not self.tally.status(kind, got[0], 200, str(got[1])):
                return
            self.tally.same(kind, got, self.solo[key])
            self.tally.done(kind, time.perf_counter() - began)
        elif roll < 0.75:
            self.cancel(rng, clients)
        else:
            name, path, body, headers, want = rng.choice(self.bad)
            status, payload = post(self.port, path, body, headers)
            if self.tally.status(f"bad_{name}", status, want) and not error_shaped(path, payload):
                self.tally.status(f"bad_{name}", -1, want, "the error's shape")
            self.tally.done("bad_input")

    def cancel(self, rng: random.Random, clients: tuple) -> None:
        oa, an = clients
        prompt, events = rng.choice(PROMPTS), rng.randint(0, 4)
        way = rng.choice(["raw_openai", "raw_anthropic", "openai_client", "anthropic_client"])
        if way == "raw_openai":
            body = {"prompt": prompt, "max_tokens": 400, "stream": True}
            self.tally.status("cancel_raw_openai", cut_raw(self.port, "/v1/completions", body, events), 200)
        elif way == "raw_anthropic":
            body = {
                "model": MODEL,
                "max_tokens": 400,
                "stream": True,
                "messages": [{"role": "user", "content": prompt}],
            }
            self.tally.status("cancel_raw_anthropic", cut_raw(self.port, "/v1/messages", body, events), 200)
        elif way == "openai_client":
            stream = oa.chat.completions.create(
                model=MODEL, max_tokens=400, stream=True, messages=[{"role": "user", "content": prompt}]
            )
            for i, _ in enumerate(stream):
                if i >= events:
                    break
            stream.close()
        else:
            with an.messages.stream(
                model=MODEL, max_tokens=400, messages=[{"role": "user", "content": prompt}]
            ) as stream:
                for i, _ in enumerate(stream):
                    if i >= events:
                        break
        self.tally.done(f"cancel_{way}")

    def run(self, clients: int, seconds: float, seed: int) -> None:
        deadline = time.monotonic() + seconds

        def client(i: int) -> None:
            rng = random.Random(seed + i)
            pair = self.clients()
            answers = self.answers(pair)
            while time.monotonic() < deadline:
                try:
                    self.one(rng, answers, pair)
                except Exception as exc:  # a refused connection, a client's status error: unexpected
                    self.tally.failed("exception", exc)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 600)


# -- the server and its samples ---------------------------------------------------------------------
def metrics(port: int, key: str | None = KEY) -> dict[str, float]:
    """The server's /metrics as {sample name with labels: value} (also bench_prefill_latency's)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# the server's memory by layer (melix_mlx.serve.memory), sampled beside its RSS, in MB
MEMORY = (
    "mlx_active_memory_bytes",
    "mlx_cache_memory_bytes",
    "mlx_peak_memory_bytes",
    "malloc_in_use_bytes",
    "malloc_free_bytes",
    "prompt_cache_bytes",
)


class Sampler(threading.Thread):
    """The server's RSS and prompt cache every `every` seconds."""

    def __init__(self, pid: int, port: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.port, self.every = pid, port, every
        self.began = time.monotonic()
        self.rss: list[tuple[float, float]] = []
        self.cache: list[dict[str, float]] = []
        self.memory: list[dict[str, float]] = []  # MB of each layer (MEMORY), beside the RSS
        self.stopped = threading.Event()

    def sample(self) -> None:
        t = round(time.monotonic() - self.began, 1)
        self.rss.append((t, round(rss_mb(self.pid), 1)))
        m = metrics(self.port)
        layers = {k: round(m[f"melix_{k}"] / 2**20, 2) for k in MEMORY if f"melix_{k}" in m}
        self.memory.append({"t": t, **layers, "python_gc_objects": m.get("melix_python_gc_objects")})
        self.cache.append(
            {
                "t": t,
                **{
                    k.removeprefix("melix_prompt_cache_"): m.get(k, float("nan"))
                    for k in (
                        "melix_prompt_cache_entries",
                        "melix_prompt_cache_max_entries",
                        "melix_prompt_cache_bytes",
                        "melix_prompt_cache_max_bytes",
                    )
                },
            }
        )

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            with contextlib.suppress(OSError):
                self.sample()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen, list[str]]:
    exe = shutil.which("melix-fsm") or str(Path(sys.executable).parent / "melix-fsm")
    command = [
        exe,
        "serve",
        "--port",
        str(port),
        "--max-batch-size",
        str(args.clients),
        "--num-draft-tokens",
        "2",
        "--device-policy",
        "force_on",
        "--api-key",
        KEY,
        "--max-body-bytes",
        str(BODY_LIMIT),
    ]
    if args.model:
        command += ["--model", args.model]
    process = subprocess.Popen(command, stdout=args.log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited {process.returncode}: see {args.log}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return process, ["melix-fsm", *command[1:]]
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=60.0, help="minutes of load (default 60)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load (instead of --minutes)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument(
        "--warmup-minutes",
        type=float,
        default=None,
        help="samples before this are left out of the slope (default: a quarter of the run)",
    )
    p.add_argument("--max-slope", type=float, default=20.0, help="MB/hour above which RSS is not flat")
    p.add_argument("--log", type=Path, default=Path("/tmp/soak_serve_server.log"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.duration is not None:
        args.minutes = args.duration / 60.0
    seconds = 60.0 * args.minutes
    warmup = 60.0 * (args.warmup_minutes if args.warmup_minutes is not None else args.minutes / 4)
    port = free_port()
    process, command = start(args, port)
    tally = Tally()
    soak = Soak(port, tally)
    try:
        solo_began = time.monotonic()
        soak.measure_solo()
        solo_s = time.monotonic() - solo_began
        sampler = Sampler(process.pid, port, args.sample_s)
        sampler.sample()
        sampler.start()
        began = time.monotonic()
        soak.run(args.clients, seconds, args.seed)
        duration = time.monotonic() - began
        sampler.stopped.set()
        sampler.join(60)
        sampler.sample()
        final = metrics(port)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    slope = slope_per_hour(sampler.rss, warmup)
    entries = max(c["entries"] for c in sampler.cache)
    cache_bound = sampler.cache[-1]["max_entries"]
    cache_bytes = max(c["bytes"] for c in sampler.cache)
    by_state = {k.split('"')[1]: v for k, v in final.items() if k.startswith("melix_requests_total{")}
    after = [v for t, v in sampler.rss if t >= warmup]
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "server_command": " ".join(command),
        "regime": "openblas-1-thread" if "openblas" in os.environ.get("LD_PRELOAD", "") else "reference-blas",
        "env": {
            k: v
            for k, v in os.environ.items()
            if k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS") or k.startswith("MALLOC_")
        },
        "machine": f"{os.cpu_count()} cpus, shared with other engineers' work (contended)",
        "duration_s": round(duration, 1),
        "clients": args.clients,
        "solo_answers": len(soak.solo),
        "solo_s": round(solo_s, 1),
        "requests": dict(sorted(tally.counts.items())),
        "requests_total": sum(tally.counts.values()),
        "unexpected": len(tally.unexpected),
        "unexpected_examples": tally.unexpected[:10],
        "mismatches": len(tally.mismatches),
        "mismatch_examples": tally.mismatches[:10],
        "latency": tally.latency(),
        "rss_mb": {
            "start": sampler.rss[0][1],
            "after_warmup": after[0] if after else None,
            "end": sampler.rss[-1][1],
            "max": max(v for _, v in sampler.rss),
        },
        "rss_warmup_s": warmup,
        "rss_slope_mb_per_hour": None if slope is None else round(slope, 2),
        "rss_samples": sampler.rss,
        "memory_slopes_mb_per_hour": memory_slopes(sampler.memory, warmup),
        "memory_samples": sampler.memory,
        "prompt_cache": {
            "max_entries_seen": entries,
            "entry_bound": cache_bound,
            "max_bytes_seen": cache_bytes,
            "byte_bound": sampler.cache[-1]["max_bytes"],
        },
        "server_requests_by_state": by_state,
        "memory_trim": {
            k: final.get(f"melix_memory_{k}") for k in ("trims", "trim_seconds", "trim_released_bytes")
        },
        "load_average_end": os.getloadavg(),
    }
    flat = slope is not None and abs(slope) <= args.max_slope
    report["ok"] = not tally.unexpected and not tally.mismatches and entries <= cache_bound and flat
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, flush=True)
    print(
        f"soak: {report['requests_total']} requests in {duration / 60:.1f} min, "
        f"unexpected {len(tally.unexpected)}, "
        f"mismatches {len(tally.mismatches)}, RSS slope {report['rss_slope_mb_per_hour']} MB/h "
        f"({report['rss_mb']}), prompt cache <= {entries:.0f}/{cache_bound:.0f} entries; ok={report['ok']}",
        file=sys.stderr,
        flush=True,
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
