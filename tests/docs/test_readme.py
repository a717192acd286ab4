"""The README's code blocks run as written, so the front page cannot drift from the code.

Rules of this file:
- Every fenced code block in README.md carries a marker line right above it:
  `<!-- readme-test: setup -->` (the fresh-machine commands: not run here, CI runs them),
  `run` (a Python block, run as is in a subprocess) or `serve` (a shell block that starts
  `melix-fsm serve` in the background, then a client command: the test starts the
  server on a free port, waits for /health, runs the client line against it and stops
  the server). Mermaid blocks are generated diagrams (`melix-fsm diagram --check`).
  A block without a marker fails here: nothing is skipped silently.
- Every wait is bounded; the server is always stopped.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<kind>\w+) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)

pytest.importorskip("mlx_lm")


def blocks() -> list[tuple[str | None, str, str]]:
    return [(m["kind"], m["lang"], m["body"]) for m in BLOCK.finditer(README.read_text())]


def test_every_code_block_is_marked() -> None:
    found = blocks()
    assert found, "the README has code blocks"
    for kind, lang, body in found:
        if lang == "mermaid":
            continue
        assert kind in ("setup", "run", "serve"), f"unmarked README block:\n{body}"
    assert [k for k, lang, _ in found if lang != "mermaid"].count("setup") == 1


def test_python_blocks_run() -> None:
    runs = [body for kind, _, body in blocks() if kind == "run"]
    assert runs
    for body in runs:
        done = subprocess.run(
            [sys.executable, "-c", body], capture_output=True, text=True, timeout=300, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), "the example prints what it generated"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_parts(body: str, port: int) -> tuple[list[str], str]:
    """(the server's argv, the client's shell line) from a serve block, on `port`."""
    server_line, client = [line for line in body.strip().splitlines() if line.strip()]
    command = server_line.split("&&")[-1].strip().removesuffix("&").strip()
    assert command.startswith("melix-fsm serve"), command
    argv = command.replace("--port 8080", f"--port {port}").split()
    return [sys.executable, "-m", "melix_fsm.cli", *argv[1:]], client.replace("8080", str(port))


def test_serve_block_answers(tmp_path: Path) -> None:
    serves = [body for kind, _, body in blocks() if kind == "serve"]
    assert serves
    for body in serves:
        port = _free_port()
        argv, client = _serve_parts(body, port)
        log = tmp_path / "serve.log"  # a file, not a pipe: a chatty server never blocks on it
        with log.open("w") as sink:
            server = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while True:
                assert server.poll() is None, log.read_text()[-2000:]
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, "the server did not come up in 180 s"
                    time.sleep(0.5)
            env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
            done = subprocess.run(
                client, shell=True, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
            )
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.strip(), "the client printed the completion"
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
