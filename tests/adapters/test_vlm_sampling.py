"""Sampled MTP decoding of an image row has the target's distribution (the mlx-vlm path).

Setup: the tiny VL checkpoint (tests/adapters/vlm_helpers.py), an image prompt, sampling
at temp 1 and top_k 4, so the joint of the first two tokens has 16 cells. t1 comes from
the prefill (mlx-vlm's features on the row's cache), t2 from the first speculative cycle
(k = 1: the checkpoint's trained head drafts from the prompt's last hidden, the draft is
accepted with min(1, p/q), else the residual is drawn). The exact joint p(t1) p(t2 | t1)
is computed from the language model over the same prompt features, t2's row at the
multimodal position past the prompt, with the sampler's own filters. A G-test as in
test_decode_sampling.py; fixed seeds, false-failure rate alpha = 1e-3 over the seed. A
wrong acceptance rule (every draft taken) must fail it. Slow (opt-in, `-m slow`): each
draw prefills the image prompt again, ~0.27 s here, 326 s for both tests.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL.Image")

import melix_mlx.runtime.engine as engine_mod  # noqa: E402
from melix_mlx.decoding.decode import MTPDecoder  # noqa: E402
from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities  # noqa: E402
from melix_mlx.vlm import prepare  # noqa: E402
from test_decode_sampling import ALPHA, g_test  # noqa: E402  (tests/adapters is on sys.path)
from vlm_helpers import IMAGE_PROMPT, image, loaded_vl  # noqa: E402

SAMPLES = 600
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    model, processor, head, _ = loaded_vl()
    inputs = prepare(model, processor, IMAGE_PROMPT, [image(0)])
    ids = inputs["input_ids"][0].tolist()
    grid = inputs["image_grid_thw"]
    prompt = model.features(inputs["input_ids"], inputs["pixel_values"], image_grid_thw=grid)
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)

    def after(tokens: list[int]) -> mx.array:
        cache = model.prompt_cache(prompt)
        logits = model(mx.array([ids]), cache)
        for t in tokens:  # decode steps past the prompt, at the row's multimodal positions
            logits = model(mx.array([[t]]), cache)
        return probabilities(normalize_logits(logits[0, -1]), params)

    p1 = after([])
    joint: dict[tuple[int, int], float] = {}
    for t1 in _support(p1):
        p2 = after([t1])
        for t2 in _support(p2):
            joint[(t1, t2)] = p1[t1].item() * p2[t2].item()
    return model, head, ids, prompt, sampler, joint


def _support(p: mx.array) -> list[int]:
    return [i for i, v in enumerate(p.tolist()) if v > 0]


def _draw_pairs(setup, n: int, seed: int) -> tuple[Counter, Counter]:
    model, head, ids, prompt, sampler, _ = setup
    mx.random.seed(seed)
    counts: Counter = Counter()
    totals: Counter = Counter()
    for _ in range(n):
        cache = model.prompt_cache(prompt)
        decoder = MTPDecoder(model, head, prompt_cache=cache, num_draft_tokens=1, sampler=sampler)
        t1, t2 = (t for t, _, _ in decoder.generate(mx.array(ids), 2))
        counts[(t1, t2)] += 1
        totals.update({"accepted": decoder.stats["accepted"], "rejected": decoder.stats["rejected"]})
    return counts, totals


def test_image_row_samples_the_targets_joint(setup) -> None:
    joint = setup[-1]
    assert len(joint) == 16 and abs(sum(joint.values()) - 1.0) < 1e-5
    counts, totals = _draw_pairs(setup, SAMPLES, seed=20261207)
    assert set(counts) <= set(joint), f"impossible pairs drawn: {set(counts) - set(joint)}"
    assert totals["accepted"] > SAMPLES // 10 and totals["rejected"] > SAMPLES // 20  # both branches ran
    assert g_test(counts, joint) > ALPHA


def test_a_wrong_rule_on_an_image_row_is_caught(setup, monkeypatch) -> None:
    def accept_all(drafts, q, logprobs, params):
        k = drafts.shape[0]
        return mx.array(k, mx.int32), mx.random.categorical(mx.log(probabilities(logprobs, params)[k]))

    monkeypatch.setattr(engine_mod, "accept_sampled", accept_all)
    counts, _ = _draw_pairs(setup, SAMPLES, seed=7)
    assert g_test(counts, setup[-1]) < ALPHA
