"""A sharded `melix-fsm serve` on 2 local ranks (mlx.launch, ring backend on 127.0.0.1).

Every wait is bounded; the launch runs in its own process group, which `close` kills
(mlx.launch leaves its ranks running when it is killed itself).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # two ranks import mlx and load on a loaded 2-core machine
EXIT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ShardedServer:
    def __init__(self, tmp: Path, *serve_args: str, ranks: int = 2) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])
        self.port = free_port()
        ring = free_port() + 1  # mlx.launch takes ranks' ring ports upwards from here
        command = [sys.executable, "-m", "melix_fsm.cli", "serve", "--port", str(self.port), *serve_args]
        launch = ["mlx.launch", "--backend", "ring", "-n", str(ranks), "--starting-port", str(ring), "--"]
        self.err_path, self.out_path = tmp / "launch.err", tmp / "launch.out"
        self._err: IO[bytes] = self.err_path.open("wb")
        self._out: IO[bytes] = self.out_path.open("wb")
        # stdin is a pipe that stays open: mlx.launch polls its stdin and spins on /dev/null
        self.launcher = subprocess.Popen(
            launch + command, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=self._out, stderr=self._err,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.pids: dict[int, int] = {}

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until rank 0 listens (its start line), both ranks named their pids."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.stderr
            self.pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+)/\d+ pid (\d+)", text)}
            if f"on {self.url} " in text and len(self.pids) == 2:
                return
            if self.launcher.poll() is not None:
                raise AssertionError(f"the launch ended before serving:\n{text[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no server within {timeout} s:\n{self.stderr[-3000:]}")

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> dict[int, str]:
        """mlx.launch's end (it exits 0 whatever its ranks return): each rank's logged status."""
        self.launcher.wait(timeout)
        return exit_codes(self.stderr)

    def close(self) -> None:
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)
            self.launcher.wait(EXIT_TIMEOUT_S)
        for pid in self.pids.values():  # a rank left outside the group: by its pid, if still ours
            if self.owns_rank(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._err.close()
        self._out.close()


    def owns_rank(self, pid: int) -> bool:
        """Whether `pid` is still a live rank of this server (a zombie or another process: no)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"melix_fsm.cli" in argv and str(self.port).encode() in argv


def exit_codes(stderr: str) -> dict[int, str]:
    """{rank: "killed" or its non-zero status} from mlx.launch's log (absent: exited 0)."""
    out = {int(r): c for r, c in re.findall(r"Node with rank (\d+) exited with code (-?\d+)", stderr)}
    out.update({int(r): "killed" for r in re.findall(r"Node with rank (\d+) was killed", stderr)})
    return out
