"""Graceful drain: SIGTERM/SIGINT (or `drain()`) stop accepting, fail what is queued,
let started requests finish up to the drain timeout, end the rest with an error event
and a finish reason, and the command exits 0. Also the API key from the environment.

Real servers on 127.0.0.1 ephemeral ports; every wait bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import TIMEOUT_S, client, host_port, metric, raw, serving, wait_until  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


def open_stream(url: str, payload: dict, headers: dict | None = None) -> tuple[Any, Any]:
    host, port = host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    sent = {"Content-Type": "application/json", **(headers or {})}
    body = json.dumps({**payload, "stream": True}).encode()
    conn.request("POST", "/v1/completions", body=body, headers=sent)
    response = conn.getresponse()
    return conn, response


def events(response: Any) -> list[Any]:
    """The stream's data events to its end ('[DONE]' kept as a string)."""
    out = []
    for line in response:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_drain_fails_queued_and_ends_started_streams(tmp_path: Path) -> None:
    from melix_mlx.serve.limits import ServeLimits
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(None, 2, "force_on")
    limits = ServeLimits(drain_timeout_s=1.5)
    with serving(served, max_batch_size=1, limits=limits) as running:
        url = running.url
        conn, started = open_stream(url, {"prompt": "Once upon a time", "max_tokens": 20000})
        assert started.status == 200 and started.readline()  # it is generating
        waiting: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: waiting.put(raw(url, "POST", "/v1/completions", json.dumps(
            {"prompt": "The king of", "max_tokens": 3}).encode())), daemon=True).start()
        assert wait_until(lambda: metric(url, "melix_requests_in_flight") == 2, timeout=20)
        began = time.monotonic()
        running.drain()
        status, _, body = waiting.get(timeout=TIMEOUT_S)  # queued: failed at once
        assert status == 503 and json.loads(body)["error"]["code"] == "drain"
        seen = events(started)  # started: ended at the drain timeout
        took = time.monotonic() - began
        conn.close()
        assert 1.0 <= took < 1.5 + 10.0, took
        assert seen[-1] == "[DONE]"
        assert seen[-2]["error"]["code"] == "drain_timeout"
        assert seen[-3]["choices"][0]["finish_reason"] == "abort"
        running.thread.join(TIMEOUT_S)
        assert not running.thread.is_alive()  # uvicorn returned: nothing accepts any more
        with pytest.raises(OSError):
            raw(url, "GET", "/health", timeout=2)


def test_a_started_request_that_ends_in_time_finishes_normally() -> None:
    from melix_mlx.serve.limits import ServeLimits
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(None, 2, "force_on")
    with serving(served, max_batch_size=2, limits=ServeLimits(drain_timeout_s=30)) as running:
        conn, started = open_stream(running.url, {"prompt": "The king of", "max_tokens": 40})
        assert started.status == 200 and started.readline()
        running.drain()
        seen = events(started)
        conn.close()
        assert seen[-1] == "[DONE]" and seen[-2]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in seen if isinstance(e, dict))


def test_sigterm_drains_and_exits_0_with_the_key_from_the_environment(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "adapters")]),
           "MELIX_FSM_API_KEY": "env-key"}
    command = [sys.executable, "-m", "melix_fsm.cli", "serve", "--port", "0", "--drain-timeout", "1",
               "--max-batch-size", "2"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line = ""
        while " on http://" not in line:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        url = line.split(" on ")[1].split()[0]
        assert raw(url, "GET", "/health")[0] == 200
        assert raw(url, "GET", "/v1/models")[0] == 401
        answer = client(url, "env-key").completions.create(model="stdlib-tiny", prompt="The", max_tokens=2)
        assert answer.usage.completion_tokens == 2
        conn, started = open_stream(url, {"prompt": "Once upon a time", "max_tokens": 20000},
                                    {"Authorization": "Bearer env-key"})
        assert started.status == 200 and started.readline()
        proc.send_signal(signal.SIGTERM)
        seen = events(started)
        conn.close()
        assert seen[-1] == "[DONE]" and seen[-2]["error"]["code"] == "drain_timeout"
        assert seen[-3]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)
