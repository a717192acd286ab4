"""Seeded requests in the batch: each row's own random stream, whatever its neighbours.

A sampled request with a seed joins the batch (no plain single-sequence path) and its
answer is the same alone, beside other requests of every kind (greedy, sampled, another
seed, a longer prompt), and on a server without MTP: each position's draw is keyed by the
seed and the position (melix_mlx.serve.seeded). A sampled request without a seed now
speculates (the rejection rule) instead of decoding plainly. Real servers on loopback
ports; every wait bounded.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from melix_mlx.loading.checkpoints import EMBEDDED  # noqa: E402
from serve_helpers import client, post_json, serving  # noqa: E402  (tests/adapters is on sys.path)

CKPT = EMBEDDED["stdlib-tiny"]
SEEDED = {
    "model": "stdlib-tiny",
    "prompt": "def parse(text):",
    "max_tokens": 20,
    "temperature": 1.0,
    "seed": 7,
}
pytestmark = pytest.mark.skipif(not (CKPT / "config.json").exists(), reason="no embedded checkpoint")


@pytest.fixture(scope="module")
def urls() -> Any:
    from melix_mlx.serve.provider import load_served_model

    speculative = load_served_model(None, 2, "force_on")
    plain = load_served_model(None, method="none")
    with serving(speculative, max_batch_size=4) as mtp, serving(plain, max_batch_size=4) as none:
        yield mtp.url, none.url


def ask(url: str, **fields: Any) -> Any:
    return client(url).completions.create(**{**SEEDED, **fields})


def test_a_seeded_answer_is_the_same_whatever_shares_the_batch(urls: Any) -> None:
    mtp, plain = urls
    alone = ask(mtp)
    spec = alone.usage.model_extra["speculative"]
    assert spec["method"] == "mtp" and spec["proposed"] > 0  # in the batch, drafting
    neighbours = [
        {"prompt": "import os", "temperature": 0, "seed": None},
        {"prompt": "class Node:", "temperature": 0.8, "seed": None},
        {"prompt": "x = [", "seed": 99},
        {"prompt": "def main():\n    " * 12, "temperature": 0.7, "seed": 1},
    ]
    with ThreadPoolExecutor(len(neighbours) + 1) as pool:
        others = [
            pool.submit(ask, mtp, **{k: v for k, v in n.items() if v is not None}) for n in neighbours[:3]
        ]
        crowded = pool.submit(ask, mtp)
        others.append(pool.submit(ask, mtp, **neighbours[3]))
        answers = [f.result() for f in others]
        crowded = crowded.result()
    assert crowded.choices[0].text == alone.choices[0].text
    assert all(a.usage.completion_tokens > 0 for a in answers)
    assert ask(plain).choices[0].text == alone.choices[0].text  # the same draws without MTP
    other_seed = ask(mtp, seed=8).choices[0].text
    assert other_seed != alone.choices[0].text and ask(mtp, seed=8).choices[0].text == other_seed


def test_a_sampled_request_without_a_seed_speculates(urls: Any) -> None:
    mtp, _ = urls
    answer = client(mtp).completions.create(
        model="stdlib-tiny", prompt="import os", max_tokens=12, temperature=0.8
    )
    spec = answer.usage.model_extra["speculative"]
    assert spec["method"] == "mtp" and spec["proposed"] > 0 and "reason" not in spec


def test_xtc_rows_decode_plainly_in_the_batch_and_say_why(urls: Any) -> None:
    mtp, _ = urls
    answer = client(mtp).completions.create(
        model="stdlib-tiny",
        prompt="import os",
        max_tokens=6,
        temperature=0.8,
        extra_body={"xtc_probability": 0.5, "xtc_threshold": 0.1},
    )
    spec = answer.usage.model_extra["speculative"]
    assert spec["method"] == "none" and "unknown sampler" in spec["reason"]


@pytest.mark.parametrize("fields", [{"logprobs": True}, {"top_logprobs": 2}, {"xtc_probability": 0.5}])
def test_a_seed_with_what_its_draw_cannot_give_is_a_400(urls: Any, fields: dict) -> None:
    mtp, _ = urls
    status, _, payload = post_json(mtp, "/v1/completions", {**SEEDED, **fields})
    assert status == 400 and payload["error"]["param"] == "seed", payload
