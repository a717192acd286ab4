"""A failure in one request's decoding ends that request only (500 or an error event).

The fault is injected through the server's own seam: a `ServingResponseGenerator`
subclass whose logits processors gain one that raises on its Nth call for requests whose
logit_bias names the sentinel token (with a zero bias: the answer is otherwise unchanged).
A real server on 127.0.0.1 (ephemeral port), the real `openai` client, bounded waits.
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
TIMEOUT_S = 60.0
SENTINEL = "7"  # a token id; a zero bias on it changes nothing
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def url() -> Any:
    from melix_mlx.serve.app import start_server
    from melix_mlx.serve.provider import load_served_model
    from melix_mlx.serve.runtime import ServingResponseGenerator
    from mlx_lm.server import _make_logits_processors

    def processors(args: Any) -> list:
        out = list(_make_logits_processors(args))
        bias = args.logits.logit_bias or {}
        if int(SENTINEL) in bias:
            fail_at = int(bias[int(SENTINEL)] == 0.0) * 3  # the third call (a decode step)
            calls = itertools.count()

            def boom(tokens: Any, logits: Any) -> Any:
                if next(calls) >= fail_at:
                    raise RuntimeError("injected processor failure")
                return logits

            out.append(boom)
        return out

    class Faulty(ServingResponseGenerator):
        def substitutions(self) -> dict[str, Any]:
            return {**super().substitutions(), "_make_logits_processors": processors}

    served = load_served_model(None, 2, "force_on")
    running = start_server(served, max_batch_size=8, generator_class=Faulty)
    yield running.url
    running.stop()


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def complete(url: str, prompt: str, **kw: Any) -> Any:
    return client(url).completions.create(
        model="default_model", prompt=prompt, max_tokens=24, temperature=0, **kw
    )


def test_a_failing_request_gets_500_and_the_others_finish(url: str) -> None:
    solo = [complete(url, p).choices[0].text for p in ("The king of", "Once upon a time there")]
    start = threading.Barrier(3, timeout=TIMEOUT_S)

    def good(prompt: str) -> str:
        start.wait()
        return complete(url, prompt).choices[0].text

    def bad() -> int:
        start.wait()
        try:
            complete(url, "In the morning the", logit_bias={SENTINEL: 0})
        except openai.InternalServerError as exc:
            assert "injected processor failure" in str(exc)
            return exc.status_code
        return 200

    with ThreadPoolExecutor(3) as pool:
        goods = [pool.submit(good, p) for p in ("The king of", "Once upon a time there")]
        failed = pool.submit(bad)
        assert failed.result(timeout=TIMEOUT_S) == 500
        assert [f.result(timeout=TIMEOUT_S) for f in goods] == solo


def test_a_failing_prefill_gets_500(url: str) -> None:
    with pytest.raises(openai.InternalServerError):
        complete(url, "The king of", logit_bias={SENTINEL: 0.5})  # raises on the first call
    assert complete(url, "The king of").choices[0].text


def test_a_failing_stream_ends_with_an_error_event(url: str) -> None:
    stream = complete(url, "The king of", logit_bias={SENTINEL: 0}, stream=True)
    with pytest.raises(openai.APIError, match="injected processor failure"):
        for _ in stream:
            pass
    with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    assert complete(url, "Once upon a time there").choices[0].text


def test_an_insertion_that_raises_fails_its_request_only() -> None:
    """mlx-lm's loop would die of an exception from insert_segments; ours answers the request."""
    from queue import Queue

    from melix_mlx.loading import load_with_heads
    from melix_mlx.serve.metrics import ServeMetrics
    from melix_mlx.serve.runtime import ServingBatchGenerator

    model, tokenizer, head, _ = load_with_heads(CKPT)
    contexts: dict = {}
    ctx = type("Ctx", (), {"queue": Queue(), "stop": lambda self: None, "speculative": None})()
    gen = ServingBatchGenerator(model, head, contexts=contexts, pending=[ctx], metrics=ServeMetrics())
    (uid,) = gen.insert_segments([[]], max_tokens=[4])  # an empty prompt: a ValueError inside
    prompt_responses, generation = gen.next()
    assert [r.uid for r in prompt_responses] == [uid] and generation == []
    assert isinstance(ctx.queue.get(timeout=5), ValueError)
    assert uid not in contexts
    (other,) = gen.insert([tokenizer.encode("The king of")], max_tokens=[3])
    tokens = []
    for _ in range(100):
        tokens += [r.token for r in gen.next()[1]]
        if len(tokens) == 3:
            break
    assert len(tokens) == 3


def test_a_refused_checkpoint_is_served_plainly_and_says_so() -> None:
    """No MTP head (the embedded draft model): mlx-lm's answers, the refusal in receipt and usage."""
    draft = EMBEDDED["stdlib-tiny-draft"]
    if not (draft / "config.json").exists():
        pytest.skip("no draft checkpoint")
    from melix_mlx.serve.app import start_server
    from melix_mlx.serve.provider import load_served_model
    from mlx_lm import generate, load

    served = load_served_model(str(draft), None, None)
    assert served.method == "none" and served.refusal
    running = start_server(served, max_batch_size=4)
    try:
        answer = complete(running.url, "The king of")
        with urllib.request.urlopen(running.url + "/v1/melix/receipt", timeout=TIMEOUT_S) as response:
            receipt = json.loads(response.read())
    finally:
        running.stop()
    spec = answer.usage.model_extra["speculative"]
    assert spec["method"] == "none" and spec["proposed"] == 0 and spec["reason"]
    assert receipt["method"] == "none" and receipt["receipt"]["mode"] == "refused"
    model, tokenizer = load(str(draft))
    assert answer.choices[0].text == generate(model, tokenizer, "The king of", max_tokens=24)


def test_a_dying_generation_loop_fails_its_requests_and_restarts() -> None:
    """mlx-lm's loop raising outside its own guards used to kill the generation thread (and
    with it every request to come); its requests now fail and a fresh loop serves on."""
    from melix_mlx.serve.app import start_server
    from melix_mlx.serve.provider import load_served_model
    from melix_mlx.serve.runtime import ServingResponseGenerator

    class Dying(ServingResponseGenerator):
        def _is_batchable(self, args: Any) -> bool:  # read by mlx-lm's loop outside any try
            if args.max_tokens == 7:
                raise RuntimeError("injected loop failure")
            return super()._is_batchable(args)

    running = start_server(load_served_model(None, 2, "force_on"), max_batch_size=4, generator_class=Dying)
    try:
        with pytest.raises(openai.InternalServerError, match="injected loop failure"):
            client(running.url).completions.create(model="default_model", prompt="The king of", max_tokens=7)
        with urllib.request.urlopen(running.url + "/health", timeout=TIMEOUT_S) as response:
            assert json.loads(response.read()) == {"status": "ok"}
        assert complete(running.url, "The king of").choices[0].text
    finally:
        running.stop()
