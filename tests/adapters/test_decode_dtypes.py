"""Greedy identity beyond float32: float16 weights and a 4-bit quantized main model.

MTP output must equal mlx-lm's `generate_step` token for token with the same loaded model,
at depths 1 and 2, for every family, with a head that drafts mlx-lm's own continuation
(wrong every third position, so both acceptance and rollback run). bfloat16 is left out on
purpose: a (k+1)-token verify can round a near-tie differently from a one-token forward
(README, "Exactness").
"""

from __future__ import annotations

import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.convert import convert
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.tools.tiny import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from scripted_head import ScriptedHead

PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [5, 17, 33, 2, 9, 41, 7, 8, 9]]
N = 24


def _check(model, head) -> None:
    for prompt in PROMPTS:
        want = reference(model, prompt, N)
        longer = reference(model, prompt, N + 4)
        hidden = main_parts(model).args.hidden_size
        scripted = ScriptedHead([prompt + longer], VOCAB_SIZE, hidden, wrong_every=3)
        for k in (1, 2):
            assert mtp(model, head, prompt, N, k)[0] == want
            got, decoder = mtp(model, scripted, prompt, N, k)
            assert got == want
            assert decoder.stats["accepted"] > 0 and decoder.stats["rollbacks"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_float16_identity(tiny_checkpoint, family: str) -> None:
    model, _, head, _ = load_with_heads(tiny_checkpoint(family, dtype="float16"))
    try:
        reference(model, PROMPTS[0], 2)
    except RuntimeError as exc:  # mlx's CPU expert gather (MoE) runs float32 only
        if "GatherMM" in str(exc):
            pytest.skip(f"mlx-lm itself cannot run this model here: {exc}")
        raise
    _check(model, head)


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_identity(tiny_dirs, tmp_path, family: str) -> None:
    out = convert(tiny_dirs[family], tmp_path / f"{family}-q4", quantize=True, q_group_size=32)
    model, _, head, info = load_with_heads(out)
    assert info.main_quantized
    _check(model, head)
