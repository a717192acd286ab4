"""`melix-fsm serve --sharding` on 2 ranks (mlx.launch, ring backend on 127.0.0.1).

- Greedy identity: concurrent requests, streamed and not, answer token for token what
  the single-process server answers; MTP ran. Also with cancelled streams among them (rows
  leave a running sharded batch mid-run on every rank): one cancellation, and two beside
  more requests (slow). The rank timeout is per batched step, so a long turn on this
  loaded CPU is not a lost rank.
- SIGTERM on rank 0 drains as on one process (the started stream finishes) and every
  rank exits 0 (rank 0's shutdown command reaches the follower).
- A follower killed with SIGKILL: the open requests get 503 / an error event with code
  `rank_lost`, and rank 0 exits 4 within its rank timeout (plus a margin). A follower
  that hangs (SIGSTOP, slow): the same, found by rank 0's watchdog.
- What mlx-lm cannot shard is refused at start on every rank, exit 3, typed.
Also, without a launch: rank 0's command survives the pickle its followers read, the
cancel flag never crosses ranks, and the watchdog fires once.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("openai")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import client, raw, serving  # noqa: E402
from sharded_server import ShardedServer, exit_codes  # noqa: E402

CKPT = EMBEDDED["stdlib-hybrid"]
PROMPTS = ["def parse_args(argv):", "import os", "class Parser:", "for i in range(", "return self."]
MAX_TOKENS = 16
RANK_TIMEOUT_S = 15.0  # per batched step (a cold first prefill on this loaded CPU took 5 s)
launched = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch not installed")
SERVE = ("--model", "stdlib-hybrid", "--device-policy", "force_on", "--num-draft-tokens", "2",
         "--rank-timeout", str(RANK_TIMEOUT_S))


def _answers(url: str, cancelled: int = 0, asked: int = len(PROMPTS), streamed: int = 2) -> dict[str, str]:
    """The greedy text of the first `asked` prompts (and `streamed` of them streamed), asked
    concurrently beside `cancelled` streams cancelled mid-run; then one more request."""
    c = client(url)

    def ask(prompt: str) -> tuple[str, str]:
        r = c.completions.create(model="stdlib-hybrid", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.usage.speculative["method"] == "mtp", r.usage
        return prompt, r.choices[0].text

    def ask_streamed(prompt: str) -> tuple[str, str]:
        chunks = c.completions.create(model="stdlib-hybrid", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, stream=True)
        return prompt + " (streamed)", "".join(ch.choices[0].text for ch in chunks if ch.choices)

    def cancel(prompt: str) -> tuple[str, str]:
        chunks = c.completions.create(model="stdlib-hybrid", prompt=prompt, max_tokens=4000,
                                      temperature=0, stream=True)
        for i, _ in enumerate(chunks):
            if i == 2:
                break
        chunks.close()  # the client goes away mid-stream: its row is cancelled on every rank
        return prompt + " (cancelled)", ""

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(cancel, p) for p in PROMPTS[:cancelled]]
        jobs += [pool.submit(ask, p) for p in PROMPTS[:asked]]
        jobs += [pool.submit(ask_streamed, p) for p in PROMPTS[:streamed]]
        out = dict(job.result(timeout=120) for job in jobs)
    out.update([ask(PROMPTS[0] + " x")])  # served on after the others
    return out


def _single_process_answers(cancelled: int = 0, **workload: int) -> dict[str, str]:
    from melix_mlx.serve.provider import load_served_model

    served = load_served_model(str(CKPT), 2, "force_on")
    with serving(served) as running:
        return _answers(running.url, cancelled, **workload)


def _sharded_answers(tmp_path: Path, cancelled: int, **workload: int) -> dict[str, str]:
    server = ShardedServer(tmp_path, "--sharding", "tensor", *SERVE)
    try:
        server.wait_ready()
        answers = _answers(server.url, cancelled, **workload)
    finally:
        server.close()
    assert "did not return within" not in server.stderr, server.stderr[-3000:]  # no rank was lost
    return answers


@launched
def test_sharded_server_with_a_cancellation_matches_single_process(tmp_path: Path) -> None:
    workload = {"asked": 2, "streamed": 1}
    sharded = _sharded_answers(tmp_path, 1, **workload)
    assert sharded == _single_process_answers(1, **workload)


@launched
@pytest.mark.slow
def test_sharded_server_with_cancellations_matches_single_process(tmp_path: Path) -> None:
    sharded = _sharded_answers(tmp_path, 2)
    assert sharded == _single_process_answers(2)


@launched
def test_sharded_server_matches_single_process_and_drains(tmp_path: Path) -> None:
    server = ShardedServer(tmp_path, "--sharding", "tensor", *SERVE)
    try:
        server.wait_ready()
        sharded = _answers(server.url)
        # bad input is answered 400 on rank 0 and reaches no rank's batch: serving goes on
        status, _, body = raw(server.url, "POST", "/v1/completions", b"{not json")
        assert status == 400, body
        # a seeded request joins the ranks' batch with its own stream: the same answer each time
        seeded = {"model": "stdlib-hybrid", "prompt": "import os", "max_tokens": 8, "seed": 3,
                  "temperature": 1}
        answers = [raw(server.url, "POST", "/v1/completions", json.dumps(seeded).encode()) for _ in range(2)]
        assert [a[0] for a in answers] == [200, 200], answers
        texts = [json.loads(a[2])["choices"][0]["text"] for a in answers]
        assert texts[0] == texts[1], texts
        again = client(server.url).completions.create(
            model="stdlib-hybrid", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
        )
        assert again.choices[0].text == sharded[PROMPTS[0]]
        # SIGTERM on rank 0 mid-stream: the started stream finishes, both ranks exit 0
        c = client(server.url)
        chunks = c.completions.create(model="stdlib-hybrid", prompt=PROMPTS[1], max_tokens=48,
                                      temperature=0, stream=True)
        finish = []
        for i, ch in enumerate(chunks):
            if i == 1:
                os.kill(server.pids[0], signal.SIGTERM)
            finish += [x.finish_reason for x in ch.choices if x.finish_reason]
        assert finish == ["length"]
        codes = server.wait_exit()
    finally:
        server.close()
    assert codes == {}, server.stderr[-3000:]  # mlx.launch logs every non-zero rank
    assert server.stderr.count("melix-fsm serve: stopped") == 2, server.stderr[-3000:]
    reference = _single_process_answers()
    assert sharded == reference


def _lose_follower(tmp_path: Path, how: signal.Signals) -> tuple[Exception | None, tuple, dict, float, str]:
    """Serve a long request and a stream, send the follower `how` mid-stream: (the stream's
    error, the plain request's answer, each rank's exit status, seconds from the signal to
    rank 0's exit, mlx.launch's log)."""
    server = ShardedServer(tmp_path, "--sharding", "tensor", *SERVE)
    try:
        server.wait_ready()
        plain: dict[str, tuple] = {}

        def long_request() -> None:
            payload = {"prompt": PROMPTS[2], "max_tokens": 4000}
            plain["answer"] = raw(server.url, "POST", "/v1/completions", json.dumps(payload).encode())

        waiter = threading.Thread(target=long_request, daemon=True)
        waiter.start()  # first: it is in the batch by the time the stream has tokens
        time.sleep(0.5)
        stream = client(server.url).completions.create(
            model="stdlib-hybrid", prompt=PROMPTS[0], max_tokens=4000, temperature=0, stream=True)
        stream_error, signalled = None, time.monotonic()
        try:
            for i, _ in enumerate(stream):
                if i == 2:
                    os.kill(server.pids[1], how)
                    signalled = time.monotonic()
        except Exception as exc:  # openai raises the stream's error event
            stream_error = exc
        waiter.join(RANK_TIMEOUT_S + 60)
        deadline = time.monotonic() + RANK_TIMEOUT_S + 40
        while server.owns_rank(server.pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = time.monotonic() - signalled
        if how == signal.SIGSTOP:  # let the stopped follower take mlx.launch's SIGTERM
            os.kill(server.pids[1], signal.SIGCONT)
        codes = server.wait_exit(RANK_TIMEOUT_S + 40)
    finally:
        server.close()
    return stream_error, plain["answer"], codes, ended, server.stderr


def _assert_requests_failed_with_rank_lost(stream_error: Exception | None, answer: tuple) -> None:
    assert stream_error is not None and "rank" in str(stream_error), stream_error
    assert getattr(stream_error, "body", {}).get("code") == "rank_lost", stream_error.body
    status, _, body = answer
    assert status == 503 and json.loads(body)["error"]["code"] == "rank_lost", (status, body)


@launched
def test_killed_follower_fails_open_requests_and_rank0_exits(tmp_path: Path) -> None:
    stream_error, answer, codes, ended, log = _lose_follower(tmp_path, signal.SIGKILL)
    _assert_requests_failed_with_rank_lost(stream_error, answer)
    assert codes == {1: "-9", 0: "4"}, log[-3000:]
    assert ended < RANK_TIMEOUT_S + 40
    assert '"error": "peer_lost", "rank": 0' in log


@launched
@pytest.mark.slow
def test_hung_follower_is_lost_within_the_rank_timeout(tmp_path: Path) -> None:
    """A follower that stops answering (SIGSTOP: alive, its connections open, so the ring
    reports nothing) is lost by rank 0's watchdog: the open requests fail with rank_lost
    and rank 0 exits 4 within the per-step rank timeout (plus a margin)."""
    stream_error, answer, codes, ended, log = _lose_follower(tmp_path, signal.SIGSTOP)
    _assert_requests_failed_with_rank_lost(stream_error, answer)
    assert "did not return within" in log, log[-3000:]  # the watchdog, not the ring, saw it
    assert codes.get(0) == "4" and codes.get(1) not in (None, "0"), (codes, log[-3000:])
    assert RANK_TIMEOUT_S - 3 <= ended < RANK_TIMEOUT_S + 40  # (the last beat: a step before)
    assert '"error": "peer_lost", "rank": 0' in log


@launched
def test_unshardable_is_refused_at_start_on_every_rank(tmp_path: Path) -> None:
    server = ShardedServer(tmp_path, "--sharding", "tensor", "--model", "stdlib-tiny")  # 3 attention heads
    try:
        codes = server.wait_exit(180)
    finally:
        server.close()
    # Each rank decides the refusal itself (no collective it could hang in) and says so.
    refused = "error: unsupported_sharding: tensor sharding over 2 ranks"
    assert server.stderr.count(refused) == 2, server.stderr
    # mlx.launch SIGTERMs the ranks still running once one exits non-zero, so the rank that
    # exits second may be ended by the launcher while it tears down: 3 or the launcher's -15,
    # never 0, a crash or a hang.
    assert set(codes) == {0, 1} and "3" in codes.values(), server.stderr[-3000:]
    assert set(codes.values()) <= {"3", "-15"}, server.stderr[-3000:]
    refusal = [json.loads(line) for line in server.stdout.splitlines() if line.startswith("{")]
    assert [r["error"] for r in refusal] == ["unsupported_sharding"]  # rank 0 prints it, once
    assert "num_attention_heads=3 not divisible by 2 ranks" in refusal[0]["message"]


# -- without a launch ------------------------------------------------------------------
def test_command_crosses_ranks_without_the_cancel_flag() -> None:
    from melix_mlx.serve.protocol import ServedRequest
    from melix_mlx.serve.ranks import Command, portable, restored

    request = ServedRequest("text", "import os", [], None, None, 77)
    request.cancelled.set()
    command = pickle.loads(pickle.dumps(Command((portable(request), {"max_tokens": 3}), (4, 5), False)))
    seen = restored(command.request[0])
    assert (seen.prompt, seen.max_prompt_tokens, command.cancels) == ("import os", 77, (4, 5))
    assert not seen.cancelled.is_set()  # a cancel counts from the turn that shares it
    assert request.cancelled.is_set()  # rank 0's own flag is untouched


def test_watchdog_fires_once_without_beats() -> None:
    from melix_mlx.serve.ranks import Watchdog

    fired = []
    dog = Watchdog(0.2, lambda: fired.append(time.monotonic()))
    dog.start()
    for _ in range(6):  # beating: no alarm
        time.sleep(0.05)
        dog.beat()
    assert fired == []
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(fired) == 1
    log = "Node with rank 1 exited with code -9\nNode with rank 0 was killed"
    assert exit_codes(log) == {1: "-9", 0: "killed"}


def test_every_batched_step_beats_the_watchdog() -> None:
    """The rank timeout bounds one step, not a turn: each `next()` beats once."""
    from melix_mlx.loading import load_with_heads
    from melix_mlx.serve.metrics import ServeMetrics
    from melix_mlx.serve.runtime import ServingBatchGenerator

    model, tokenizer, head, _ = load_with_heads(CKPT)
    gen = ServingBatchGenerator(model, head, contexts={}, pending=[], metrics=ServeMetrics())
    beats: list[float] = []
    gen.heartbeat = lambda: beats.append(time.monotonic())
    gen.insert([tokenizer.encode("import os")], max_tokens=[6])
    steps, finished = 0, False
    while not finished and steps < 20:
        _, generation = gen.next()
        steps += 1
        finished = any(r.finish_reason for r in generation)
    assert finished and len(beats) == steps > 1
