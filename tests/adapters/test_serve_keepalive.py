"""An idle keep-alive connection outlives common clients' pool expiry, and the setting reaches uvicorn.

A client pool (httpx, under the openai and anthropic clients) keeps an idle connection 5 s;
a server that closes it at the same moment resets the request sent on it. So the
server's default idle timeout is longer, `--keep-alive-timeout` sets it, and the value is
the one uvicorn enforces: checked on a real loopback server with a 1-second timeout (an
idle connection is reused before it, and closed by the server after it).
"""

from __future__ import annotations

import http.client
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import host_port, serving  # noqa: E402  (tests/adapters is on sys.path)

from melix_fsm.cli import build_parser, main  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
HTTPX_POOL_EXPIRY_S = 5.0  # httpx.Limits' keepalive_expiry default
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


def _limits(*flags: str) -> Any:
    from melix_mlx.commands.serve import limits_from_args

    return limits_from_args(build_parser().parse_args(["serve", "--port", "0", *flags]))


def test_default_outlives_the_client_pools_expiry() -> None:
    import httpx

    assert httpx.Limits().keepalive_expiry == HTTPX_POOL_EXPIRY_S  # the fact the default rests on
    assert _limits().timeout_keep_alive_s > HTTPX_POOL_EXPIRY_S


def test_flag_and_its_uvicorn_spelling_set_the_limit(capsys) -> None:
    assert _limits("--keep-alive-timeout", "42").timeout_keep_alive_s == 42
    assert _limits("--timeout-keep-alive", "7").timeout_keep_alive_s == 7
    assert main(["serve", "--port", "0", "--keep-alive-timeout", "-1"]) == 2
    assert "--keep-alive-timeout must be >= 0" in capsys.readouterr().err


def _health(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    return response.status


def test_uvicorn_enforces_the_setting() -> None:
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(None, 2, "force_on")
    with serving(served, max_batch_size=1, limits=_limits("--keep-alive-timeout", "1")) as running:
        assert running.server.config.timeout_keep_alive == 1
        conn = http.client.HTTPConnection(*host_port(running.url), timeout=10)
        try:
            assert _health(conn) == 200
            time.sleep(0.3)  # idle, within the timeout: the same connection serves again
            assert _health(conn) == 200
            assert conn.sock is not None
            local = conn.sock.getsockname()
            time.sleep(2.0)  # idle past the timeout: the server has closed it
            assert conn.sock.recv(1) == b""  # end of stream: closed by the server, not by us
            assert conn.sock.getsockname() == local
        finally:
            conn.close()
