"""DeepSeek-V4.1 as a speculation target: its LayerCache rolls back exactly (no replay).

On a tiny mlx-lm DeepSeek-V4.1 model (window 4; compressors of ratio 4 and 1, compressed
KV shared across layers, an indexer with candidate blocks; random weights):
- after verify forwards of 1-4 positions, mostly rejected (some wholly), each followed by
  `trim`, every layer's cache in mlx-lm's form (window, closed groups, index keys, the
  open group's rows, offset) equals a clean run fed only the confirmed tokens, across
  window evictions and compressor folds (float32, tolerance 1e-5); mlx-lm's own
  compressor (no capture) cannot be rolled back so;
- speculative decoding on it (a draft in the head slot: a scripted head that drafts wrong
  every third token, a random draft model that is mostly rejected) equals mlx-lm's greedy
  output token for token at k = 1..3, with rollbacks; so do a prompt prefilled in chunks
  and 4-bit weights (a quantized KV cache refuses speculation, typed, and still decodes
  as mlx-lm does);
- a batch and a quantized KV cache are refused for the kind, typed; the MTP method stays
  refused for the family (its mtp.* layers are a block drafter), with that reason.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from decode_refs import mtp, reference
from melix_mlx.decoding.draft_model import DraftHead
from melix_mlx.runtime import layer_kv, rollback
from mlx.utils import tree_map
from mlx_lm.models import deepseek_v41 as dsv41
from mlx_lm.models import llama
from scripted_head import ScriptedHead

from melix_fsm.reasons import RefusalReason

VOCAB = 96
WINDOW = 4
TOLERANCE = 1e-5
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 8]]
N = 16
FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")


def _randomize(model: Any, seed: int, scale: float) -> Any:
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape).astype(p.dtype) * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model() -> Any:
    args = dsv41.ModelArgs(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        head_dim=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        o_groups=2,
        o_lora_rank=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        compress_ratios=(0, 4, 4, 1),
        kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 2),
        candidate_source_layer_id=1,
        candidate_topk_blocks=2,
        candidate_block_size=2,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=3,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )
    return _randomize(dsv41.Model(args), 0, 0.3)


def _fields(c: Any) -> list[Any]:
    c = c.to_layer_cache() if isinstance(c, layer_kv.SpareLayerCache) else c
    return [c.window, c.compress_kv, c.index_k, c.pending_kv, c.pending_gate]


def _assert_equal(cache: list[Any], clean: list[Any]) -> None:
    for layer, (a, b) in enumerate(zip(cache, clean, strict=True)):
        assert a.offset == b.offset, layer
        for name, x, y in zip(FIELDS, _fields(a), _fields(b), strict=True):
            empty_x, empty_y = x is None or x.shape[1] == 0, y is None or y.shape[1] == 0
            assert empty_x == empty_y, (layer, name)
            if not empty_x:
                assert x.shape == y.shape, (layer, name, x.shape, y.shape)
                diff = float(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))))
                assert diff <= TOLERANCE, (layer, name, diff)


def _verify_and_trim(model: Any, capture: bool) -> tuple[int, int]:
    """Verify cycles over random tokens, mostly rejected; the cache is compared with a clean
    run after each. Returns (cycles that rolled back over a compressor fold, rollbacks)."""
    rng = random.Random(1)
    confirmed = [rng.randrange(VOCAB) for _ in range(7)]
    cache = model.make_cache()
    model(mx.array([confirmed]), cache)
    if capture:
        layer_kv.adopt(cache, model)
    else:  # mlx-lm's compressor: the spare window, but no record of the folded rows
        for i, c in enumerate(cache):
            cache[i] = layer_kv.SpareLayerCache.from_layer_cache(c, layer_kv._ratios(model)[i])
    folds = rollbacks = 0
    for _ in range(16):
        chunk = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        start = cache[0].offset
        model(mx.array([chunk]), cache)
        drop = rng.randint(0, len(chunk)) if rng.random() < 0.85 else 0
        for c in cache:
            c.trim(drop)
        confirmed += chunk[: len(chunk) - drop]
        rollbacks += drop > 0
        end = start + len(chunk)
        folds += drop > 0 and end // 4 > cache[0].offset // 4  # a folded group came undone
        clean = model.make_cache()
        model(mx.array([confirmed]), clean)
        _assert_equal(cache, clean)
    return folds, rollbacks


def test_trim_equals_a_clean_run(model) -> None:
    folds, rollbacks = _verify_and_trim(model, capture=True)
    assert folds >= 2 and rollbacks >= 8  # the rollbacks crossed compressor folds


def test_mlx_lms_compressor_alone_cannot_roll_back(model) -> None:
    """Without the capturing compressor the folded rows are gone: the trim is refused
    loudly (the tail lacks the open group's rows) or the cache differs from a clean run."""
    with pytest.raises((RuntimeError, AssertionError)):
        for layer in model.layers:
            if hasattr(layer.self_attn, "compressor"):
                layer.self_attn.compressor.__class__ = dsv41.Compressor
        try:
            _verify_and_trim(model, capture=False)
        finally:
            layer_kv.install(model)


def _draft_model() -> Any:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    return _randomize(llama.Model(args), 3, 0.5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_identity_with_rollbacks(model, k) -> None:
    heads = {
        "scripted": lambda scripts: ScriptedHead(scripts, VOCAB, 64, wrong_every=3),
        "draft_model": lambda scripts: DraftHead(_draft_model()),
    }
    for name, make in heads.items():
        accepted = rollbacks = 0
        for prompt in PROMPTS:
            want = reference(model, prompt, N)
            got, decoder = mtp(model, make([prompt + want]), prompt, N, k)
            assert got == want, (name, prompt, k)
            assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0
            assert all(isinstance(c, layer_kv.SpareLayerCache) for c in decoder.cache)
            accepted += decoder.stats["accepted"]
            rollbacks += decoder.stats["rollbacks"]
        assert rollbacks > 0, name  # drafts were rejected and rolled back
        if name == "scripted":
            assert accepted > 0


def test_chunked_prefill_4bit_weights_and_a_quantized_kv_cache(model) -> None:
    """A prompt prefilled in chunks, and 4-bit weights, keep identity with rollbacks; a
    quantized KV cache refuses speculation typed (mlx-lm leaves the kind unquantized) and
    still decodes as mlx-lm does."""
    prompt = PROMPTS[0]
    want = reference(model, prompt, N)
    got, decoder = mtp(model, DraftHead(_draft_model()), prompt, N, 2, prefill_step_size=3)
    assert got == want and decoder.stats["rollbacks"] > 0
    got, decoder = mtp(model, DraftHead(_draft_model()), prompt, N, 2, kv_bits=4, kv_group_size=32)
    assert got == want
    assert decoder.stats["refusal"].startswith(RefusalReason.unsupported_quantization.value)
    quantized = copy.deepcopy(model)
    nn.quantize(quantized, group_size=32, bits=4, class_predicate=_quantizable)
    assert quantized.layers[1].self_attn.compressor.kv_proj.bits == 4
    want = reference(quantized, prompt, N)
    got, decoder = mtp(quantized, ScriptedHead([prompt + want], VOCAB, 64, wrong_every=3), prompt, N, 3)
    assert got == want and decoder.stats["rollbacks"] > 0 and decoder.stats["refusal"] is None


def _quantizable(path: str, module: Any) -> bool:
    weight = getattr(module, "weight", None)
    return hasattr(module, "to_quantized") and weight is not None and weight.shape[-1] % 32 == 0


def test_batch_and_quantized_kv_are_refused_typed(model) -> None:
    from melix_fsm.registry import Support, registry

    cache = model.make_cache()
    assert rollback.cache_kinds(cache) == ["layer_cache"]
    assert rollback.refusal(cache) is None  # exact single sequence
    batched = rollback.refusal(cache, batched=True)
    assert batched is not None and batched.startswith(RefusalReason.unsupported_cache_sharing.value)
    quantized = rollback.refusal(cache, quantized_kv=True)
    assert quantized is not None and quantized.startswith(RefusalReason.unsupported_quantization.value)
    family = registry().families["deepseek_v41"]
    assert family.support is Support.refused and family.refusal is RefusalReason.unsupported_model
    assert "DSpark" in family.message and family.cache_kinds == ("layer_cache",)


def test_a_batch_of_it_is_refused_typed_before_any_row(model) -> None:
    """mlx-lm cannot merge a LayerCache (its own BatchGenerator fails on the first join);
    the batch generator refuses it at construction with a typed reason, not mid-run."""
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.loading.errors import UnsupportedServing

    with pytest.raises(UnsupportedServing) as err:
        MTPBatchGenerator(model, None, max_tokens=4)
    assert err.value.reason is RefusalReason.unsupported_cache_sharing
    assert "layer_cache" in err.value.message
