"""LongCat-Flash n-gram (LongCat-Flash-Lite): its MTP head and its n-gram context rollback.

- mlx-lm's own loader reads the tiny HF checkpoint (n-gram tables included), the project
  loader yields the same logits, the receipt admits the family with its own head module;
- the captured n-gram embedding (melix_mlx.runtime.capture_ngram) gives mlx-lm's own
  embedding bit for bit, fed whole or token by token, on prompts shorter and longer than
  its n - 1 context ids, and a right-padded joint prefill keeps each row's own context;
- the head's forward equals the LongCat-Flash reference forward (written from the
  published architecture in test_family_ernie_longcat, plain mlx ops on the raw HF
  tensors, tolerance 1e-3 on logits of scale ~10) with the PLAIN word embedding of the
  next token, and differs from it fed the n-gram embedding;
- greedy MTP decoding equals mlx-lm's greedy output token for token (references from a
  freshly loaded mlx-lm model, whose embedding is mlx-lm's own class), single sequence at
  k = 1..3 and batched (rows at k = 1, 2, 3 with a prompt shorter than the context, a row
  removed mid-run, a late joiner);
- after rejecting cycles the main cache, n-gram context included, equals a clean run fed
  only the confirmed tokens, with no replay forward;
- a 4-bit converted checkpoint keeps identity; the sampled distribution (`melix-fsm
  verify`, smoke profile) passes (marked slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import family_checks
import mlx.core as mx
import mlx_lm
import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime import capture
from melix_mlx.runtime.capture_ngram import CapturingNgramEmbedding
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.runtime.prefill import prefill_together
from mlx_lm.models import longcat_flash_ngram
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from test_family_ernie_longcat import _longcat_reference

FAMILY = "longcat_flash_ngram"
N = 12
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]
LATE = [60]
HEAD_KEYS = [
    "model.mtp.embed_tokens.weight",
    "model.mtp.layers.0.enorm.m.weight",
    "model.mtp.layers.0.hnorm.m.weight",
    "model.mtp.layers.0.eh_proj.weight",
    "model.mtp.layers.0.self_attn.kv_b_proj.weight",
    "model.mtp.layers.0.transformer_layer.mlp.down_proj.weight",
    "model.mtp.norm.weight",
    "model.embed_tokens.weight",
    "model.ngram_embeddings.embedders.5.weight",
    "model.ngram_embeddings.post_projs.0.weight",
]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint) -> tuple:
    path = tiny_checkpoint(FAMILY)
    return (path, *load_with_heads(path))


@pytest.fixture(scope="module")
def upstream(loaded):
    """mlx-lm's own model (its embedding class never replaced): the identity reference."""
    model, _ = mlx_lm.load(str(loaded[0]))
    assert type(model.model.ngram_embeddings) is longcat_flash_ngram.NgramEmbedding
    return model


def test_hf_layout_loads_with_mlx_lm_and_is_admitted(loaded):
    family_checks.hf_layout_admitted(loaded, FAMILY, HEAD_KEYS, PROMPTS[2])
    config = json.loads((loaded[0] / "config.json").read_text())
    assert config["emb_neighbor_num"] == 4 and "num_nextn_predict_layers" not in config


def _embedding(upstream, cls: type) -> longcat_flash_ngram.NgramEmbedding:
    emb = longcat_flash_ngram.NgramEmbedding(upstream.args)
    emb.update(upstream.model.ngram_embeddings.parameters())
    emb.__class__ = cls
    return emb


@pytest.mark.parametrize("tokens", [[9], [9, 200], [9, 200, 0, 31, 31, 77, 5]])
def test_captured_context_embeds_as_mlx_lm(upstream, tokens):
    """Whole or token by token, the captured embedding equals mlx-lm's, and its context
    is the last n - 1 ids left-filled with 0 (mlx-lm's own is shorter before n - 1 ids)."""
    theirs = _embedding(upstream, longcat_flash_ngram.NgramEmbedding)
    ours = _embedding(upstream, CapturingNgramEmbedding)
    x = mx.array([tokens])
    want = theirs(x, ArraysCache(1))
    for chunks in ([tokens], [[t] for t in tokens]):
        cache = ArraysCache(1)
        got = mx.concatenate([ours(mx.array([c]), cache) for c in chunks], axis=1)
        assert mx.array_equal(got, want)
        assert cache[0].tolist() == [([0, 0, 0] + tokens)[-3:]]


def test_joint_prefill_keeps_each_rows_context(loaded):
    """Right-padded rows keep the ids ending at their own last token (never the padding),
    and a row shorter than the context merges with the rest (one shape for every row)."""
    from mlx_lm.generate import _merge_caches  # mlx-lm's batch form of fresh caches

    model = loaded[1]
    capture.install(model)
    prompts = [[5, 17, 33, 2, 9, 41, 7], [100, 3], [8]]
    cache = _merge_caches([make_prompt_cache(model) for _ in prompts])
    logits, _ = prefill_together(model, prompts, cache)
    assert cache[0][0].tolist() == [([0, 0, 0] + q)[-3:] for q in prompts]
    for i, prompt in enumerate(prompts):
        single = make_prompt_cache(model)
        want, _ = forward_with_hidden(model, mx.array([prompt]), single)
        assert mx.abs(logits[i] - want[0, -1]).max().item() < 1e-4
        assert single[0][0].tolist() == cache[0][0][i : i + 1].tolist()


def test_head_forward_matches_the_published_architecture(loaded):
    path, model, _, head, _ = loaded
    raw: dict[str, mx.array] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    config = json.loads((path / "config.json").read_text())
    x = mx.array([PROMPTS[2]])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    got_logits, got_hidden = head(hidden[:, :-1], x[:, 1:], head.make_cache())
    want_logits, want_hidden = _longcat_reference(raw, config, hidden[:, :-1], x[:, 1:])
    assert mx.abs(want_logits).max().item() > 1.0  # a real signal to compare
    assert mx.abs(got_logits - want_logits).max().item() < 1e-3
    assert mx.abs(got_hidden - want_hidden).max().item() < 1e-3
    # fed the n-gram embedding of the drafted tokens instead, the reference moves by O(1)
    ngram = model.model.ngram_embeddings(x[:, 1:])[0]  # rows: one per slot
    moved = dict(raw, **{"model.mtp.embed_tokens.weight": ngram})
    other, _ = _longcat_reference(moved, config, hidden[:, :-1], mx.arange(ngram.shape[0])[None])
    assert mx.abs(other - want_logits).max().item() > 0.1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_identity_single(loaded, k):
    _, model, _, head, _ = loaded
    family_checks.greedy_identity_single(model, head, PROMPTS, N, k)


def test_greedy_identity_batched_with_removal_and_late_joiner(loaded):
    _, model, _, head, _ = loaded
    family_checks.batched_identity(model, head, PROMPTS, LATE, N)


def test_rollback_cache_equals_clean_run(loaded, monkeypatch):
    _, model, _, head, _ = loaded
    family_checks.rollback_equals_clean_run(model, head, monkeypatch)


def test_greedy_identity_against_upstream(loaded, upstream):
    _, model, _, head, _ = loaded
    for prompt in [*PROMPTS, LATE]:
        assert mtp(model, head, prompt, N, 3)[0] == reference(upstream, prompt, N)


def test_4bit_identity(loaded, tmp_path):
    family_checks.four_bit_identity(loaded[0], FAMILY, tmp_path, PROMPTS[:1], N)


@pytest.mark.slow  # ~17 s on two CPU cores; the sampled path is the engine's, shared by every family
def test_verify_smoke_passes_with_the_sampled_distribution(loaded, capsys):
    """`melix-fsm verify` (smoke profile): identity single and batched, batch invariance,
    lifecycle probes, and sampled output at T = 1 following the model's distribution."""
    from melix_fsm.cli import main

    args = ["--profile", "smoke", "--draws", "100", "--seed", "1", "--json", "--quiet"]
    code = main(["verify", "--model", str(loaded[0]), *args])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"] == "pass" and report["bugs"] == []
    assert report["identity"] == "bit-exact" and report["receipt"]["family"] == FAMILY
    assert report["parts"]["distribution (100 draws, T = 1)"]["result"] != "FAIL"
