"""Fair prefill and cancellation in any state, on a real server.

A long prompt is prefilled in chunks between the running rows' decode steps: another
client's stream keeps flowing while it prefills. A client that disconnects during its
prefill cancels it there (its remaining chunks are never prefilled) and frees its place.
Real uvicorn servers on 127.0.0.1 ephemeral ports; every wait bounded.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import TIMEOUT_S, client, healthy, host_port, metric, serving, wait_until  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
CHUNK = 32
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def served() -> Any:
    from melix_mlx.serve.provider import load_served_model

    return load_served_model(None, 2, "force_on")


@pytest.fixture(scope="module")
def url(served: Any) -> Any:
    from melix_mlx.serve.limits import ServeLimits

    with serving(served, max_batch_size=4, limits=ServeLimits(prefill_chunk_tokens=CHUNK)) as running:
        yield running.url


def long_prompt(served: Any, words: str, tokens: int) -> str:
    text = words
    while len(served.tokenizer.encode(text)) < tokens:
        text += " " + words
    return text


def test_chunked_prefill_keeps_the_answer(url: str, served: Any) -> None:
    """Chunking changes when a prompt is prefilled, not what is answered (greedy)."""
    from mlx_lm import generate

    prompt = long_prompt(served, "The old king had three sons.", 120)
    answer = client(url).completions.create(model="stdlib-tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert answer.usage.prompt_tokens > 3 * CHUNK
    assert answer.choices[0].text == generate(served.model, served.tokenizer, prompt, max_tokens=12)


def test_a_long_prefill_does_not_stall_another_stream(url: str, served: Any) -> None:
    """While a ~500-token prompt prefills (16 chunks), another stream keeps emitting.

    Bounds (generous, CPU shared with other jobs): the running stream gets at least 4
    tokens inside the long prompt's prefill window, and its longest gap between tokens
    is under half that window; prefilled whole (no chunks), the window holds about one
    token and the gap is the whole prefill."""
    arrivals: list[float] = []
    started = threading.Event()

    def running() -> None:
        stream = client(url).completions.create(
            model="stdlib-tiny", prompt="Once upon a time", max_tokens=400, temperature=0, stream=True
        )
        for _ in stream:
            arrivals.append(time.monotonic())
            started.set()

    thread = threading.Thread(target=running, daemon=True)
    thread.start()
    assert started.wait(TIMEOUT_S)
    begin = time.monotonic()
    long = client(url).completions.create(
        model="stdlib-tiny", prompt=long_prompt(served, "A fair prefill in small chunks.", 16 * CHUNK),
        max_tokens=1, stream=True,
    )
    for _ in long:
        end = time.monotonic()
        break
    thread.join(TIMEOUT_S * 2)
    window = [t for t in arrivals if begin <= t <= end]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if begin <= b <= end]
    assert len(window) >= 4, (len(window), end - begin)
    assert max(gaps) < 0.5 * (end - begin), (max(gaps), end - begin)


def test_a_disconnect_during_prefill_cancels_it_there(url: str, served: Any) -> None:
    prompt = long_prompt(served, "Nobody will read the answer to this.", 40 * CHUNK)
    before_tokens = metric(url, "melix_prompt_tokens_total")
    before_cancelled = metric(url, "melix_requests_total{state=cancelled}")
    host, port = host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True}).encode()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    line = response.fp.readline()
    while not line.startswith(b": keepalive"):  # the first chunk's progress: prefill is under way
        line = response.fp.readline()
        assert line, "the stream ended before any prefill progress"
    conn.sock.close()
    conn.close()
    assert wait_until(lambda: metric(url, "melix_requests_in_flight") == 0, timeout=30)
    assert metric(url, "melix_requests_total{state=cancelled}") == before_cancelled + 1
    prefilled = metric(url, "melix_prompt_tokens_total") - before_tokens
    assert prefilled < 40 * CHUNK / 2, prefilled  # most chunks were never prefilled
    states = ("speculating", "suspended", "plain")
    assert sum(metric(url, f"melix_batch_rows{{state={s}}}") for s in states) == 0
    assert healthy(url)


def test_a_request_past_its_deadline_is_cancelled(served: Any) -> None:
    from melix_mlx.serve.limits import ServeLimits

    with serving(served, max_batch_size=2, limits=ServeLimits(request_timeout_s=1.0)) as running:
        status_started = time.monotonic()
        import openai

        with pytest.raises(openai.APIStatusError) as caught:
            client(running.url).completions.create(model="stdlib-tiny", prompt="Once", max_tokens=20000)
        assert caught.value.status_code == 504
        assert time.monotonic() - status_started < TIMEOUT_S
        assert wait_until(lambda: metric(running.url, "melix_requests_in_flight") == 0, timeout=30)
        assert metric(running.url, "melix_requests_total{state=cancelled}") == 1
        assert client(running.url).completions.create(model="stdlib-tiny", prompt="A", max_tokens=2).choices


def test_chunking_keeps_the_system_prompt_a_reusable_prefix(url: str, served: Any) -> None:
    """Chunk ends are not segment ends: the real one (after the system prompt) is still
    stored, so another question under the same long system prompt starts from it."""
    system = long_prompt(served, "You answer in the voice of an old sailor.", 8 * CHUNK)
    chat = client(url).chat.completions

    def ask(question: str) -> Any:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return chat.create(model="stdlib-tiny", messages=messages, max_tokens=2, temperature=0)

    first = ask("Where is the ship?")
    second = ask("Who is the captain of the ship today?")
    assert first.usage.prompt_tokens > 8 * CHUNK
    assert second.usage.prompt_tokens_details.cached_tokens >= 7 * CHUNK  # the system prompt's prefix


def test_a_short_stream_starts_before_a_long_prefill_ends(served: Any) -> None:
    """Prefill by a time budget per step: with no token cap on a step's prefill (one
    4,096-token chunk), a ~900-token prompt that arrives beside a running stream is still
    prefilled in many short pieces: the running stream keeps emitting, and a short stream
    that arrives after the prefill began gets its first token before that prefill ends.
    (Without the budget the long prompt is one piece and both wait behind it.)"""
    from melix_mlx.serve.limits import ServeLimits

    limits = ServeLimits(prefill_chunk_tokens=4096, prefill_budget_s=0.02)
    with serving(served, max_batch_size=4, limits=limits) as running:
        arrivals: list[float] = []
        started = threading.Event()

        def background() -> None:
            stream = client(running.url).completions.create(
                model="stdlib-tiny", prompt="The old king", max_tokens=300, temperature=0, stream=True
            )
            for _ in stream:
                arrivals.append(time.monotonic())
                started.set()

        keeper = threading.Thread(target=background, daemon=True)
        keeper.start()
        assert started.wait(TIMEOUT_S)
        host, port = host_port(running.url)
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
        prompt = long_prompt(served, "A long prompt prefilled in timed pieces.", 900)
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "stream": True}).encode()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        progress: list[float] = []
        long_first: list[float] = []

        def read_long() -> None:
            for line in response.fp:
                if line.startswith(b": keepalive"):
                    progress.append(time.monotonic())
                elif line.startswith(b"data: {"):
                    long_first.append(time.monotonic())
                    return

        reader = threading.Thread(target=read_long, daemon=True)
        reader.start()
        assert wait_until(lambda: len(progress) >= 1, timeout=TIMEOUT_S), "no prefill progress"
        assert not long_first, "the long prefill ended before the test could start the short stream"
        stream = client(running.url).completions.create(
            model="stdlib-tiny", prompt="Once upon a time", max_tokens=4, stream=True
        )
        short_first = None
        for _ in stream:
            short_first = short_first or time.monotonic()
        reader.join(TIMEOUT_S)
        conn.close()
        keeper.join(TIMEOUT_S * 2)
        assert long_first and short_first is not None
        after = [t for t in progress if t > short_first]
        assert short_first < long_first[0] and len(after) >= 3, (short_first - long_first[0], len(after))
        # the running stream kept emitting while the long prompt prefilled: no gap near the window
        window = long_first[0] - progress[0]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if progress[0] <= b <= long_first[0]]
        assert len(gaps) >= 4 and max(gaps) < 0.5 * window, (len(gaps), max(gaps, default=0), window)


def test_prompts_are_tokenized_off_the_generation_thread(served: Any) -> None:
    """Every chat template and encoding of a request runs on the tokenizer thread."""
    import copy
    from dataclasses import replace

    tokenizer = copy.copy(served.tokenizer)
    threads: list[str] = []
    encode = tokenizer._tokenizer.encode

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    inner = copy.copy(tokenizer._tokenizer)
    inner.encode = recorded
    tokenizer._tokenizer = inner
    with serving(replace(served, tokenizer=tokenizer), max_batch_size=2) as running:
        c = client(running.url)
        c.completions.create(model="stdlib-tiny", prompt="Once upon a time", max_tokens=2)
        hello = [{"role": "user", "content": "Hi"}]
        c.chat.completions.create(model="stdlib-tiny", messages=hello, max_tokens=2)
    assert len(threads) >= 2 and all(name.startswith("melix-tokenize") for name in threads), threads


def test_the_budget_follows_each_request_and_cuts_final_pieces() -> None:
    """PrefillBudget alone: an unmeasured request gets a probe; a measured one its own rate
    (not another's), a piece at most twice its latest; a final piece longer than its share
    gives its head to the segment stage, a short one joins uncut."""
    from types import SimpleNamespace

    from melix_mlx.serve.prompt_work import PROBE, PrefillBudget

    budget = PrefillBudget(0.25, 256)
    long = SimpleNamespace(uid=1, segments=[], prompt=list(range(1000)), all_tokens=[], cache=None)
    short = SimpleNamespace(uid=2, segments=[], prompt=list(range(10)), all_tokens=[], cache=None)
    assert budget.cut([long, short], 8) == [long]  # the short prompt joins whole
    assert long.segments == [list(range(PROBE))] and len(long.prompt) == 1000 - PROBE
    budget.observe(0.01)  # 3,200 tokens/s: the next piece at most doubles
    assert budget.piece(1) == 2 * PROBE and budget.piece(2) == PROBE
    long.segments.clear()
    budget.cut([long], 8)
    budget.observe(2.0)  # 32 tokens/s (a long context): 8 tokens fit 0.25 s
    assert budget.piece(1) == 8 and budget.piece(99) == PROBE
    assert budget.cut([short], 8) == [] and 1 not in budget.rates  # gone from the queue: forgotten


def test_a_measured_join_prices_the_first_piece_of_fresh_prompts_only() -> None:
    """PrefillBudget alone: before any join a fresh prompt gets the probe; a join's rate then
    prices fresh prompts, at most twice the tokens the join attended to; a prompt with
    context, or a request measured on its own pieces, is not priced by it."""
    from types import SimpleNamespace

    from melix_mlx.serve.prompt_work import PROBE, PrefillBudget

    budget = PrefillBudget(0.25, 256)
    assert budget.piece(fresh=True) == PROBE
    budget.observe_join(tokens=45, attended=45, seconds=0.01)  # 4,500 tokens/s
    assert budget.piece(fresh=True) == 90 and budget.piece() == PROBE  # doubling; context: a probe
    budget.observe_join(tokens=200, attended=200, seconds=0.2)  # 1,000 tokens/s: 250 fit 0.25 s
    assert budget.piece(fresh=True) == 250
    fresh = SimpleNamespace(uid=3, segments=[], prompt=list(range(80)), all_tokens=[], cache=None)
    cached = SimpleNamespace(uid=4, segments=[], prompt=list(range(80)), all_tokens=[1, 2], cache=None)
    assert budget.cut([fresh, cached], 8) == [cached]  # the fresh one joins whole
    assert cached.segments == [list(range(PROBE))]  # with context: its probe goes through the segment stage


def test_a_request_arriving_mid_batch_is_inserted_before_the_next_step(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's loop takes new requests only between its turns; a turn is one generator
    step here (mlx-lm's own turn runs steps for 0.5 s: on this model about a hundred, all
    of them before the newcomer's prefill). Counted in steps, not timed."""
    from melix_mlx.serve.runtime import ServingBatchGenerator, ServingResponseGenerator

    events: list[str] = []
    step, insert, submit = (
        ServingBatchGenerator.next,
        ServingBatchGenerator.insert_segments,
        ServingResponseGenerator.submit,
    )
    monkeypatch.setattr(ServingBatchGenerator, "next", lambda self: events.append("step") or step(self))
    monkeypatch.setattr(
        ServingBatchGenerator,
        "insert_segments",
        lambda self, *a, **k: events.append("insert") or insert(self, *a, **k),
    )
    monkeypatch.setattr(
        ServingResponseGenerator, "submit", lambda self, *a: events.append("submit") or submit(self, *a)
    )
    with serving(served, max_batch_size=4) as running:
        c = client(running.url)
        stream = c.completions.create(model="stdlib-tiny", prompt="The old king", max_tokens=200, stream=True)
        next(iter(stream))  # the batch decodes
        assert wait_until(lambda: events.count("step") >= 5, timeout=TIMEOUT_S)
        c.completions.create(model="stdlib-tiny", prompt="Once upon a time", max_tokens=2)
        later = sum(1 for _ in stream)
    assert later > 0  # the first stream was still decoding when the second one was served
    second = max(i for i, event in enumerate(events) if event == "submit")
    inserted = events.index("insert", second)
    assert events[second:inserted].count("step") <= 2, events[second:inserted].count("step")


def test_a_segment_gives_the_admission_that_follows_it_its_share_of_the_budget() -> None:
    """PrefillBudget alone: the joins a step expects are priced at the latest join's rate
    and come off the segment stage's budget."""
    from types import SimpleNamespace

    from melix_mlx.serve.prompt_work import PrefillBudget

    budget = PrefillBudget(0.25, 256)
    assert budget.admission_s(45) == 0.0  # no join measured: nothing to reserve
    budget.observe_join(tokens=100, attended=100, seconds=0.1)  # 1,000 tokens/s
    assert budget.admission_s(45) == pytest.approx(0.045)
    long = SimpleNamespace(uid=1, segments=[list(range(1000))], prompt=[7], all_tokens=[0] * 64, cache={})
    budget.rates[1] = (1000.0, 200)  # its own rate: 250 tokens fill the budget
    budget.cut([long], 8)
    assert len(long.segments[0]) == 250
    long.segments[0:2] = [list(range(1000))]
    budget.cut([long], 8, reserve_s=0.15)  # a join expected to take 0.15 s: 0.1 s left
    assert len(long.segments[0]) == 100
