"""`melix-fsm serve` takes every `receipt` option, and each one acts on the served decoder.

Servers are started from the serve parser's own parsed options (`load_from_args`, what the
command runs) on 127.0.0.1 ephemeral ports, one per case, and stopped by the test. What a
setting did is read back from the response's speculative usage (per-position draft
counts), GET /v1/melix/receipt and GET /metrics, and compared with mlx-lm's own greedy
decode of the same checkpoint. Settings a batch cannot run are refused, typed, before any
weight is read (the loaders are replaced by ones that fail the test).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402

from melix_fsm.cli import build_parser, main  # noqa: E402

CKPT = EMBEDDED["stdlib-tiny"]
DRAFT = EMBEDDED["stdlib-tiny-draft"]
TIMEOUT_S = 60.0
PROMPT = "Once upon a time there"
MAX_TOKENS = 20
pytestmark = pytest.mark.skipif(
    not (CKPT / "config.json").exists() or not (DRAFT / "config.json").exists(),
    reason="no embedded checkpoints",
)


def _serve_args(*flags: str) -> Any:  # option parity itself: tests/adapters/test_cli_parity.py
    return build_parser().parse_args(["serve", "--port", "0", *flags])


@contextmanager
def _server(*flags: str) -> Iterator[tuple[Any, str]]:
    from melix_mlx.commands.serve import load_from_args
    from melix_mlx.serve.app import start_server

    served = load_from_args(_serve_args(*flags))
    running = start_server(served, max_batch_size=4)
    try:
        yield served, running.url
    finally:
        running.stop()


def _get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=TIMEOUT_S) as response:
        body = response.read()
    return body.decode() if path == "/metrics" else json.loads(body)


def _complete(url: str, prompt: str = PROMPT) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def _metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def _mlx_lm_text(served: Any) -> str:
    from mlx_lm import generate

    return generate(served.model, served.tokenizer, PROMPT, max_tokens=MAX_TOKENS)


# -- options act on the served decoder -------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_num_draft_tokens_is_the_served_depth(k: int) -> None:
    with _server("--num-draft-tokens", str(k), "--device-policy", "force_on") as (served, url):
        before = _get(url, "/metrics")
        answer = _complete(url)
        after = _get(url, "/metrics")
        info = _get(url, "/v1/melix/receipt")
        want = _mlx_lm_text(served)
    spec = answer["usage"]["speculative"]
    assert spec["method"] == "mtp"
    assert len(spec["position_proposed"]) == k and min(spec["position_proposed"]) > 0  # drafts k deep
    assert spec["proposed"] == sum(spec["position_proposed"])
    grown = _metric(after, "melix_speculative_proposed_tokens_total") - _metric(
        before, "melix_speculative_proposed_tokens_total"
    )
    assert grown == spec["proposed"]
    assert info["num_draft_tokens"] == k and info["settings"]["num_draft_tokens"] == k
    assert info["receipt"]["num_draft_tokens"] == k and info["receipt"]["effective_depth"] == k
    assert answer["choices"][0]["text"] == want


def test_method_none_serves_plainly() -> None:
    with _server("--method", "none", "--num-draft-tokens", "2") as (served, url):
        answer = _complete(url)
        info = _get(url, "/v1/melix/receipt")
        metrics = _get(url, "/metrics")
        want = _mlx_lm_text(served)
    spec = answer["usage"]["speculative"]
    assert spec["method"] == "none" and spec["proposed"] == 0 and spec["cycles"] == 0
    assert spec["reason"].startswith("operator_disabled")
    assert answer["choices"][0]["text"] == want
    assert info["method"] == "none" and info["num_draft_tokens"] == 0 and served.head is None
    receipt = info["receipt"]
    assert receipt["mode"] == "legacy_only" and receipt["refusal_reason"] == "operator_disabled"
    assert _metric(metrics, "melix_speculation_method") == 1.0 and 'method="none"' in metrics


def test_draft_model_method_is_served() -> None:
    flags = ("--method", "draft_model", "--draft-model", "stdlib-tiny-draft", "--num-draft-tokens", "2")
    with _server(*flags, "--device-policy", "force_on") as (served, url):
        answer = _complete(url)
        info = _get(url, "/v1/melix/receipt")
        want = _mlx_lm_text(served)
    spec = answer["usage"]["speculative"]
    assert spec["method"] == "draft_model" and len(spec["position_proposed"]) == 2
    assert answer["choices"][0]["text"] == want
    assert info["method"] == "draft_model" and info["receipt"]["requested_method"] == "draft_model"
    assert info["settings"]["draft_model"] == DRAFT.name  # no path leaves the host


def test_profile_and_auto_depth_are_served(tmp_path) -> None:
    profile = tmp_path / "serve.toml"
    profile.write_text('num_draft_tokens = "auto"\ndevice_policy = "force_on"\n')
    with _server("--profile", str(profile)) as (served, url):
        info = _get(url, "/v1/melix/receipt")
    assert info["settings"]["num_draft_tokens"] == "auto" and info["settings"]["profile"] == profile.name
    assert info["receipt"]["source"]["num_draft_tokens"] == "profile"
    assert info["num_draft_tokens"] == served.controller.depth.max_k == info["receipt"]["depth"]["max_k"]


# -- refusals at start ------------------------------------------------------------------------
@pytest.fixture
def no_loading(monkeypatch) -> None:
    """Fail the test if anything loads weights."""
    from melix_mlx.loading import method_load

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(method_load, "load_plain", forbidden)
    monkeypatch.setattr(method_load, "load_for_method", forbidden)


@pytest.mark.parametrize(
    "flags",
    [
        ("--kv-bits", "8"),  # MLA (deepseek_v3): no quantized cache at all
        ("--quantized-kv", "--method", "none"),
        ("--model", "stdlib-tiny-draft", "--kv-bits", "4", "--kv-group-size", "32"),  # llama: no batch cache
    ],
)
def test_quantized_kv_is_refused_typed_at_start(flags, no_loading, capsys) -> None:
    assert main(["serve", "--port", "0", *flags]) == 3
    out, err = capsys.readouterr()
    refused = json.loads(out)
    assert refused["error"] == "unsupported_quantization" and refused["receipt"]["quantized_kv"] is True
    assert "unsupported_quantization" in err and "quantized" in err


def test_explicitly_requested_refused_method_fails_closed(no_loading, capsys) -> None:
    assert main(["serve", "--port", "0", "--model", "stdlib-tiny-draft", "--method", "mtp"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == "unsupported_model" and "unsupported_model" in err


def test_bad_serve_settings_are_usage_errors(no_loading, capsys) -> None:
    assert main(["serve", "--port", "0", "--method", "draft_model"]) == 2  # no --draft-model
    assert main(["serve", "--port", "0", "--kv-group-size", "32"]) == 2  # no --kv-bits
    assert main(["serve", "--port", "0", "--num-draft-tokens", "0"]) == 2
    assert capsys.readouterr().err.count("melix-fsm serve: error:") == 3
