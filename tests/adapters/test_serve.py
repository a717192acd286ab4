"""`melix-fsm serve` end to end: a real server on 127.0.0.1, the real `openai` client.

One MTP server (embedded stdlib-tiny, k=2, policy forced on) and one mlx-lm server (its own
ResponseGenerator and handler, plain mlx_lm.load of the same checkpoint) per module, on
ephemeral ports, stopped by the fixtures. Every wait is bounded by a client timeout or a
polling deadline. Answers are compared token for token through their text and counts.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
TIMEOUT_S = 60.0
PROMPTS = ["The king of", "Once upon a time there", "In the morning the", "She said that", "A small"]
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def served() -> Any:
    from melix_mlx.serve.provider import load_served_model

    return load_served_model(None, 2, "force_on")


@pytest.fixture(scope="module")
def server(served: Any) -> Any:
    from melix_mlx.serve.app import start_server

    running = start_server(served, max_batch_size=8, max_tokens_limit=4096, names=("stdlib-tiny",))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def mlx_lm_server(served: Any) -> Any:
    """mlx-lm's own server (ModelProvider loads the checkpoint with mlx_lm.load)."""
    from melix_mlx.serve.app import mlx_settings
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator

    settings = mlx_settings(served, max_batch_size=8)
    generator = ResponseGenerator(ModelProvider(settings), LRUPromptCache(10))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: APIHandler(generator, *a, **k))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()
    thread.join(TIMEOUT_S)


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def complete(url: str, prompt: str, max_tokens: int = 24, **kw: Any) -> Any:
    return client(url).completions.create(
        model="default_model", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def metrics(url: str) -> dict[str, float]:
    status, body = raw(url, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def rows(url: str) -> float:
    m = metrics(url)
    return sum(v for k, v in m.items() if k.startswith("melix_batch_rows{"))


# -- identity -----------------------------------------------------------------------------
def test_greedy_completions_equal_mlx_lm_server(server: Any, mlx_lm_server: str) -> None:
    for prompt in PROMPTS:
        ours, theirs = complete(server.url, prompt), complete(mlx_lm_server, prompt)
        assert ours.choices[0].text == theirs.choices[0].text, prompt
        assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
        assert ours.usage.completion_tokens == theirs.usage.completion_tokens
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


def test_greedy_token_ids_and_logprobs_equal_mlx_lm_server(server: Any, mlx_lm_server: str) -> None:
    for prompt in PROMPTS[:3]:
        body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": True}).encode()
        ours_lp, theirs_lp = (
            json.loads(raw(url, "POST", "/v1/completions", body)[1])["choices"][0]["logprobs"]["content"]
            for url in (server.url, mlx_lm_server)
        )
        assert [t["id"] for t in ours_lp] == [t["id"] for t in theirs_lp], prompt
        assert [t["logprob"] for t in ours_lp] == pytest.approx([t["logprob"] for t in theirs_lp], abs=1e-4)


def test_greedy_chat_equals_mlx_lm_server_and_mtp_drafted(server: Any, mlx_lm_server: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    answers = []
    for url in (server.url, mlx_lm_server):
        answers.append(
            client(url).chat.completions.create(
                model="default_model", messages=messages, max_tokens=32, temperature=0
            )
        )
    ours, theirs = answers
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens
    spec = ours.usage.model_extra["speculative"]
    assert spec["method"] == "mtp" and spec["proposed"] > 0
    assert spec["accepted"] + spec["rejected"] <= spec["proposed"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / (spec["accepted"] + spec["rejected"]))


def test_prompt_cache_reuse_keeps_the_answer(server: Any) -> None:
    first = complete(server.url, "The old house on the hill")
    again = complete(server.url, "The old house on the hill")
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # continued from the prompt cache
    assert again.choices[0].text == first.choices[0].text


def test_streaming_equals_non_streaming(server: Any) -> None:
    for prompt in PROMPTS[:3]:
        whole = complete(server.url, prompt, max_tokens=32)
        text, usage = "", None
        options = {"include_usage": True}
        chunks = complete(server.url, prompt, max_tokens=32, stream=True, stream_options=options)
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert text == whole.choices[0].text
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        assert usage.model_extra["speculative"]["method"] == "mtp"


def test_eight_concurrent_clients_get_their_solo_answers(server: Any) -> None:
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS + PROMPTS[:3])]
    solo = [complete(server.url, p, max_tokens=40).choices[0].text for p in prompts]
    start = threading.Barrier(len(prompts), timeout=TIMEOUT_S)

    def one(prompt: str) -> str:
        start.wait()
        return complete(server.url, prompt, max_tokens=40).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, prompts, timeout=TIMEOUT_S))
    assert together == solo
    scraped = metrics(server.url)
    assert scraped["melix_batch_rows_peak"] >= 2  # they really shared batches
    # the parts of a gap are timed: steps, admissions, and the loop between steps while rows ran
    steps, admissions = scraped["melix_step_seconds_count"], scraped["melix_admission_seconds_count"]
    assert steps >= 40 and 1 <= admissions <= steps and scraped["melix_between_steps_seconds_count"] >= 1
    longest = scraped["melix_step_seconds_max"]
    assert longest > 0 and scraped["melix_step_seconds_sum"] <= steps * longest


def test_cancelled_stream_frees_its_row(server: Any) -> None:
    before = metrics(server.url)["melix_generated_tokens_total"]
    stream = complete(server.url, "Once upon a time", max_tokens=4000, stream=True)
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen >= 2:
            break
    assert rows(server.url) >= 1
    stream.close()
    deadline = time.monotonic() + 20
    while rows(server.url) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rows(server.url) == 0
    assert server.generator.metrics.tracked_rows == 0  # the removed row's counters went with it
    assert metrics(server.url)["melix_generated_tokens_total"] - before < 4000  # removed, not finished
    assert complete(server.url, "A small").choices[0].text  # still serving


# -- bad input ----------------------------------------------------------------------------
BAD_POSTS = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -5}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**12}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": True}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}).encode()),
    ("/v1/completions", json.dumps({"prompt": 123}).encode()),
    ("/v1/completions", json.dumps({"max_tokens": 3}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": 5}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "stream": "yes"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [1, 2]}).encode()),
    ("/v1/nothing", json.dumps({"prompt": "hi"}).encode()),
]


def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server: Any) -> None:
    for path, body in BAD_POSTS:
        status, payload = raw(server.url, "POST", path, body)
        assert 400 <= status < 500, (path, body, status)
        assert "error" in json.loads(payload), (path, body)
    status, payload = raw(server.url, "GET", "/v1/unknown")
    assert status == 404 and "error" in json.loads(payload)
    assert json.loads(raw(server.url, "GET", "/health")[1]) == {"status": "ok"}
    assert complete(server.url, "The king of", max_tokens=4).usage.completion_tokens == 4


def test_openai_client_sees_bad_requests_as_errors(server: Any) -> None:
    with pytest.raises(openai.BadRequestError):
        complete(server.url, "hi", max_tokens=10**9)
    with pytest.raises(openai.NotFoundError):  # another model: refused, nothing is downloaded
        client(server.url).completions.create(model="someone/else", prompt="hi", max_tokens=2)


# -- receipt, metrics, models -----------------------------------------------------------
def test_receipt_endpoint(server: Any) -> None:
    status, body = raw(server.url, "GET", "/v1/melix/receipt")
    assert status == 200
    data = json.loads(body)
    assert data["method"] == "mtp" and data["num_draft_tokens"] == 2 and data["refusal"] is None
    assert data["receipt"]["mode"] == "accepted"
    assert data["settings"]["device_policy"] == "force_on"
    assert data["policy"]["speculating"] is True


def test_metrics_endpoint_counts_speculation(server: Any) -> None:
    before = metrics(server.url)
    answer = complete(server.url, "In the morning the", max_tokens=16)
    after = metrics(server.url)
    spec = answer.usage.model_extra["speculative"]
    grown = {k: after[k] - before[k] for k in ("melix_speculative_proposed_tokens_total",
                                                "melix_speculative_accepted_tokens_total",
                                                "melix_generated_tokens_total")}
    assert grown["melix_speculative_proposed_tokens_total"] == spec["proposed"]
    assert grown["melix_speculative_accepted_tokens_total"] == spec["accepted"]
    assert grown["melix_generated_tokens_total"] == answer.usage.completion_tokens
    assert 0.0 <= after["melix_speculative_acceptance_rate"] <= 1.0
    assert after["melix_generation_tokens_per_second"] >= 0.0
    assert 'melix_speculation_method{method=mtp}' in after
    assert "melix_policy_decisions_total{decision=suspend}" in after


def test_models_endpoint_lists_the_served_name_and_no_path(server: Any) -> None:
    data = client(server.url).models.list()
    ids = [m.id for m in data.data]
    assert ids[0] == CKPT.name  # the served name: the checkpoint directory's base name
    assert not any("/" in i or "\\" in i for i in ids)
    answer = client(server.url).completions.create(model=ids[0], prompt="The king of", max_tokens=2)
    assert answer.model == ids[0]


def test_a_greedy_request_with_a_seed_speculates_in_the_batch(server: Any) -> None:
    answer = complete(server.url, "The king of", seed=3)
    spec = answer.usage.model_extra["speculative"]
    assert spec["method"] == "mtp" and "reason" not in spec
    assert answer.choices[0].text == complete(server.url, "The king of").choices[0].text


# -- the command ----------------------------------------------------------------------------
def test_serve_command_usage_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    from melix_fsm.cli import main

    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert main(["serve", "--model", "/nonexistent/checkpoint"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize("inherited_sigint", ["default", "ignored"])
def test_serve_command_runs_until_interrupted(tmp_path: Any, inherited_sigint: str) -> None:
    """SIGINT stops the server with exit 0, also when it was started with SIGINT ignored
    (how a background job of a non-interactive shell starts: `melix-fsm serve &`)."""
    import os
    import queue
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "adapters")])}
    command = [sys.executable, "-m", "melix_fsm.cli", "serve", "--port", "0", "--device-policy", "force_on"]
    command += ["--num-draft-tokens", "2"]
    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    preexec = ignore_sigint if inherited_sigint == "ignored" else None
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, preexec_fn=preexec
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line, printed = "", None
        while "http://" not in line:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith("melix-fsm serve: receipt: "):  # every start prints its receipt
                printed = json.loads(line.removeprefix("melix-fsm serve: receipt: "))
        url = line.split(" on ")[1].split()[0]
        with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as response:
            assert json.loads(response.read()) == {"status": "ok"}
        with urllib.request.urlopen(url + "/v1/melix/receipt", timeout=TIMEOUT_S) as response:
            body = response.read()
        # the operator's stderr names the checkpoint's path; the API only its served name
        assert str(CKPT.resolve()).encode() not in body
        assert printed is not None and printed["model"] == str(CKPT.resolve())
        assert {**printed, "model": CKPT.name} == json.loads(body)["receipt"]
        assert printed["num_draft_tokens"] == 2 and printed["batched"] is True
        assert complete(url, "The king of", max_tokens=4).usage.completion_tokens == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT_S)
