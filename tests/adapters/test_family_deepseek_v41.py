"""DeepSeek-V4.1: its LayerCache rolls back exactly (no replay), and its DSpark drafter runs.

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
- a batch and a quantized KV cache are refused for the kind, typed.
On the make-tiny checkpoint (published layout, the DSpark drafter as ``mtp.{0,1,2}.*``):
- it loads as ONE head over its three stages, its taps declared, logits unchanged;
- the drafter's block equals an independent forward written from DeepSeek's published
  ``inference/model.py`` (DSparkAttention / DSparkBlock / forward_head: taps = streams
  entering the target layers averaged, window context, non-causal block seeded with the
  noise token, Markov bias of the previous token), every draft of the block, float32,
  tolerance 1e-4 of the logits' scale; a wrong tap (a layer's output) or a causal block
  is caught;
- greedy decoding with it equals mlx-lm at k = 1..3; with its Markov head scripted to the
  target's bigrams, drafts are accepted (deep chains served from one block) and still
  equal; after decoding, the main cache and the drafter's caches equal a clean run over
  the confirmed tokens.
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
    assert family.support is Support.mtp and family.head_module == "deepseek_v41"
    assert "DSpark" in family.doc and family.cache_kinds == ("layer_cache",)
    assert "layer_cache" in registry().unmergeable


def test_a_batch_of_it_is_refused_typed_before_any_row(model) -> None:
    """mlx-lm cannot merge a LayerCache (its own BatchGenerator fails on the first join);
    the batch generator refuses it at construction with a typed reason, not mid-run."""
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.loading.errors import UnsupportedServing

    with pytest.raises(UnsupportedServing) as err:
        MTPBatchGenerator(model, None, max_tokens=4)
    assert err.value.reason is RefusalReason.unsupported_cache_sharing
    assert "layer_cache" in err.value.message


def test_mlx_lms_forward_cannot_hold_rows_at_different_positions(model) -> None:
    """Why the batch is refused, measured: mlx-lm's DeepSeek-V4.1 forward takes no mask and
    prices every row at `cache[0].offset` (one RoPE offset, one set of window indices, one
    compressor grouping), so a shorter row left-padded beside a longer one is not its solo
    run, while rows at one position are. There is no batched mlx-lm output to be identical
    to (mlx-lm's server serves this family one request at a time: no `merge`). If mlx-lm
    grows a mask or per-row offsets, this fails and the refusal is to be revisited."""
    import inspect

    assert list(inspect.signature(type(model).__call__).parameters) == ["self", "inputs", "cache"]
    assert not hasattr(dsv41.LayerCache, "merge")
    long_row, short_row = PROMPTS[0], PROMPTS[1]
    padded = [0] * (len(long_row) - len(short_row)) + short_row

    def last_logits(rows: list[list[int]]) -> mx.array:
        return model(mx.array(rows), model.make_cache())[:, -1].astype(mx.float32)

    solo_short, solo_long = last_logits([short_row])[0], last_logits([long_row])[0]
    batch = last_logits([long_row, padded])
    same_position = last_logits([long_row, long_row])
    assert float(mx.max(mx.abs(same_position[1] - solo_long))) <= TOLERANCE
    assert float(mx.max(mx.abs(batch[0] - solo_long))) <= TOLERANCE
    assert float(mx.max(mx.abs(batch[1] - solo_short))) > 1e-2


# -- the DSpark drafter on its make-tiny checkpoint ----------------------------------------
DSPARK_PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
DSPARK_N = 12


@pytest.fixture(scope="module")
def dspark(tiny_checkpoint) -> Any:
    from melix_mlx.loading import load_with_heads

    path = tiny_checkpoint("deepseek_v41")
    model, _, head, info = load_with_heads(path)
    config = __import__("json").loads((path / "config.json").read_text())
    return model, head, info, config


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: mx.array, positions: mx.array, base: float, rd: int, inverse: bool = False) -> mx.array:
    """model.py's apply_rotary_emb: adjacent pairs of the trailing rd features as complex
    numbers times exp(i * position * base^(-2j / rd)); the inverse conjugates."""
    tail = x[..., -rd:].astype(mx.float32)
    angle = positions.reshape(-1, *([1] * (x.ndim - 2)), 1) * base ** (-mx.arange(0, rd, 2) / rd)
    cos, sin = mx.cos(angle), (-1.0 if inverse else 1.0) * mx.sin(angle)
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = mx.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(tail.shape)
    return mx.concatenate([x[..., :-rd], rotated.astype(x.dtype)], axis=-1)


def _fp8(x: mx.array) -> mx.array:
    """act_quant: e4m3 round trip per 32 features, power-of-two scale over amax / 448."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = mx.maximum(mx.max(mx.abs(blocks), axis=-1, keepdims=True), 1e-4)
    scale = 2.0 ** mx.ceil(mx.log2(amax / 448.0))
    q = mx.from_fp8(mx.to_fp8(mx.clip(blocks / scale, -448.0, 448.0)), mx.float32) * scale
    return q.reshape(x.shape)


def _sink_attention(q: mx.array, kv: mx.array, sink: mx.array, scale: float) -> mx.array:
    """sparse_attn over every given row: softmax with each head's sink in the denominator."""
    scores = mx.einsum("shd,kd->shk", q, kv) * scale
    top = mx.maximum(mx.max(scores, axis=-1), sink)
    e = mx.exp(scores - top[..., None])
    denom = mx.sum(e, axis=-1) + mx.exp(sink - top)
    return mx.einsum("shk,kd->shd", e, kv) / denom[..., None]


def _collapse(x: mx.array, mix: mx.array) -> mx.array:  # Block.hc_pre
    return mx.sum(mix[..., None] * x, axis=-2)


def _expand(x: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:  # Block.hc_post
    return post[..., None] * x[..., None, :] + mx.sum(comb[..., None] * residual[..., :, None, :], axis=-3)


def _reference_taps(model: Any, tokens: list[int], targets: list[int], after: bool = False) -> mx.array:
    """Transformer.forward's main_hidden: the streams ENTERING each target layer, averaged
    (`after`: the layer's output instead, the wrong tap)."""
    inner = model.model
    n = len(tokens)
    streams = mx.broadcast_to(inner.embed_tokens(mx.array([tokens]))[:, :, None], (1, n, 2, 64))
    pre_mix = mx.zeros((1, n, 2)).at[..., 0].add(1.0)
    idx = dsv41._window_indices(previous=0, length=n, window=WINDOW)[None]
    cache, shared, taps = inner.make_cache(), {}, []
    for i, layer in enumerate(inner.layers):
        if i in targets and not after:
            taps.append(mx.mean(streams, axis=2))
        streams, pre_mix = layer(streams, pre_mix, start_pos=0, window_idx=idx, cache=cache[i], shared=shared)
        if i in targets and after:
            taps.append(mx.mean(streams, axis=2))
    return mx.concatenate(taps, axis=-1)[0]


def _reference_block(model, head, config, taps, seed, causal=False) -> mx.array:
    """DSparkBlock / DSparkAttention / forward_head over the context `taps` [L, T * D] and the
    seed token at position L: the block's pre-norm hidden [block, D]. The trunk block pieces
    (hyper-connection mixes, the MoE) are the stage's own modules: their math is the
    trunk's, which every identity test checks; the DSpark wiring is written here."""
    eps, base, rd = config["rms_norm_eps"], config["rope_theta"], config["qk_rope_head_dim"]
    size, p = config["dspark_block_size"], taps.shape[0] - 1
    main_x = _rms(taps @ head.main_proj.weight.T, head.main_norm.weight, eps)
    ctx_pos = mx.arange(max(0, p - WINDOW + 1), p + 1)
    block_pos = p + 1 + mx.arange(size)
    ids = mx.array([seed] + [config["dspark_noise_token_id"]] * (size - 1))
    x = mx.broadcast_to(model.model.embed_tokens(ids)[:, None], (size, 2, 64))
    pre_mix = mx.zeros((size, 2)).at[:, 0].add(1.0)
    for stage in head.stages:
        a = stage.self_attn
        ctx = _fp8(
            _rope(_rms(main_x @ a.kv_proj.weight.T, a.kv_norm.weight, eps), mx.arange(p + 1), base, rd)
        )
        ctx = ctx[ctx_pos]
        attn_pre, attn_post, attn_comb = (m[0] for m in stage.attn_hc(x[None]))
        h = _rms(_collapse(x, pre_mix), stage.input_layernorm.weight, eps)
        q = (_rms(h @ a.q_a_proj.weight.T, a.q_a_norm.weight, eps) @ a.q_b_proj.weight.T).reshape(size, 2, 32)
        q = _rope(q, block_pos, base, rd)
        kv = _fp8(_rope(_rms(h @ a.kv_proj.weight.T, a.kv_norm.weight, eps), block_pos, base, rd))
        if causal:  # the wrong form: each block position sees only the block before it
            o = mx.concatenate(
                [
                    _sink_attention(q[i : i + 1], mx.concatenate([ctx, kv[: i + 1]]), a.sinks, 32**-0.5)
                    for i in range(size)
                ]
            )
        else:  # DSparkAttention: every block query sees the context rows and the whole block
            o = _sink_attention(q, mx.concatenate([ctx, kv]), a.sinks, 32**-0.5)
        o = _rope(o, block_pos, base, rd, inverse=True).reshape(size, 2, -1)
        o = mx.einsum("sgd,grd->sgr", o, a.o_a_proj.weight).reshape(size, -1) @ a.o_b_proj.weight.T
        x = _expand(o, x, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = (m[0] for m in stage.ffn_hc(x[None]))
        h = stage.mlp(_rms(_collapse(x, attn_pre), stage.post_attention_layernorm.weight, eps)[None])[0]
        x, pre_mix = _expand(h, x, ffn_post, ffn_comb), ffn_pre
    return _collapse(x, pre_mix)


def _head_logits(head, hidden: mx.array, pairs: list[int], previous: list[int]) -> list[mx.array]:
    seeds = head.trunk(hidden, mx.array([pairs]), head.make_cache())[:, -1:]
    out = [head.logits(seeds)[0, 0]]
    for i, token in enumerate(previous[1:], start=1):
        out.append(head.chain_step(i, seeds, mx.array([[token]], mx.uint32))[0][0, 0])
    return out


def test_dspark_loads_as_one_head_with_its_taps(dspark) -> None:
    from melix_mlx.runtime.hidden import forward_with_hidden, taps_of

    model, head, info, config = dspark
    assert info.head_layers == 1 and info.advertised_layers == 3 and info.refusal is None
    assert len(head.stages) == 3 and taps_of(model) == (1, 2, 3)
    assert head.stages[0].mlp.experts.switch_mlp.gate_proj.weight.shape[0] == 2  # dspark_n_routed_experts
    assert head.stages[0].mlp.gate.top_k == 1 and model.layers[0].mlp.gate.top_k == 2
    x = mx.array([DSPARK_PROMPT])
    logits, hidden = forward_with_hidden(model, x, model.make_cache())
    assert mx.array_equal(logits, model(x, model.make_cache())).item()  # taps change no logit
    assert hidden.shape[-1] == 4 * 64
    want = _reference_taps(model, DSPARK_PROMPT, [1, 2, 3])
    assert mx.abs(hidden[0, :, 64:] - want).max().item() <= 1e-6
    assert (
        mx.abs(hidden[0, :, 64:] - _reference_taps(model, DSPARK_PROMPT, [1, 2, 3], after=True)).max().item()
        > 1e-2
    )


def test_dspark_block_equals_the_published_forward(dspark) -> None:
    from melix_mlx.runtime.hidden import forward_with_hidden

    model, head, _, config = dspark
    x = mx.array([DSPARK_PROMPT])
    _, hidden = forward_with_hidden(model, x, model.make_cache())
    seed = 65
    taps = _reference_taps(model, DSPARK_PROMPT, [1, 2, 3])
    block = _reference_block(model, head, config, taps, seed)
    base = _rms(block, head.norm.weight, config["rms_norm_eps"]) @ model.lm_head.weight.T
    markov = head.markov_head.head.weight @ head.markov_head.embed.weight.T  # [V, V]: column = previous
    previous, want = [seed], []
    for i in range(config["dspark_block_size"]):
        want.append(base[i] + markov[:, previous[-1]])
        previous.append(int(mx.argmax(want[-1]).item()))
    got = _head_logits(head, hidden, DSPARK_PROMPT[1:] + [seed], previous[:-1])
    scale = max(1.0, max(mx.abs(w).max().item() for w in want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert mx.abs(g - w).max().item() <= 1e-4 * scale, i
    # the test sees the difference a causal block would make
    causal = _reference_block(model, head, config, taps, seed, causal=True)
    assert mx.abs(causal[0] - block[0]).max().item() > 1e-3


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dspark_greedy_identity(dspark, k) -> None:
    model, head, _, _ = dspark
    want = reference(model, DSPARK_PROMPT, DSPARK_N)
    got, decoder = mtp(model, head, DSPARK_PROMPT, DSPARK_N, k)
    assert got == want
    assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0


class _Bigrams(nn.Module):
    """A Markov head scripted to the target's bigrams: drafts the target's own next token."""

    def __init__(self, text: list[int], vocab: int) -> None:
        super().__init__()
        table = mx.zeros((vocab, vocab))
        for a, b in zip(text, text[1:]):
            table = table.at[a].multiply(0.0).at[a, b].add(1e4)
        self.table = table

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.table[tokens]


def test_dspark_accepted_chains_and_exact_rollback(dspark) -> None:
    """Drafts accepted deep (one block serves the chain) and rejected alike keep identity;
    afterwards the main cache and every stage's cache equal a clean run."""
    from melix_mlx.runtime.hidden import forward_with_hidden

    model, head, _, _ = dspark
    want = reference(model, DSPARK_PROMPT, DSPARK_N)
    original = head.markov_head
    head.markov_head = _Bigrams(DSPARK_PROMPT + want, original.head.weight.shape[0])
    try:
        got, decoder = mtp(model, head, DSPARK_PROMPT, DSPARK_N, 3)
    finally:
        head.markov_head = original
    assert got == want and decoder.stats["accepted"] >= DSPARK_N // 2
    got, decoder = mtp(model, head, DSPARK_PROMPT, DSPARK_N, 3)  # the random drafter: rejected
    assert got == want and decoder.stats["rollbacks"] > 0
    text = DSPARK_PROMPT + want[:-1]  # the caches hold every token but the last
    clean = model.make_cache()
    _, hidden = forward_with_hidden(model, mx.array([text]), clean)
    _assert_equal(decoder.cache, clean)
    clean_head = head.make_cache()
    head.trunk(hidden, mx.array([text[1:] + [want[-1]]]), clean_head)
    for c, d in zip(decoder.head_cache, clean_head, strict=True):
        assert c.offset == d.offset == len(text)
        assert mx.abs(c.keys[..., : c.offset, :] - d.keys[..., : d.offset, :]).max().item() <= TOLERANCE


def test_dspark_converted_and_4bit(dspark, tiny_checkpoint, tmp_path) -> None:
    """The converted head (dspark_config carried along) drafts exactly as the raw one; on
    4-bit weights greedy decoding with it still equals mlx-lm."""
    from melix_mlx.loading import load_with_heads
    from melix_mlx.loading.convert import convert
    from melix_mlx.runtime.hidden import forward_with_hidden

    model, head, _, _ = dspark
    x = mx.array([DSPARK_PROMPT])
    converted = load_with_heads(convert(tiny_checkpoint("deepseek_v41"), tmp_path / "float"))
    assert converted.info.head_format == "melix" and converted.info.head_layers == 1
    outs = []
    for m, h in ((model, head), (converted.model, converted.head)):
        _, hidden = forward_with_hidden(m, x, m.make_cache())
        outs.append(h.logits(h.trunk(hidden[:, :-1], x[:, 1:], h.make_cache())[:, -1:]))
    assert mx.array_equal(outs[0], outs[1]).item()
    q_model, _, q_head, info = load_with_heads(
        convert(tiny_checkpoint("deepseek_v41"), tmp_path / "q4", quantize=True)
    )
    assert info.main_quantized and info.refusal is None
    want = reference(q_model, DSPARK_PROMPT, 8)
    got, decoder = mtp(q_model, q_head, DSPARK_PROMPT, 8, 2)
    assert got == want and decoder.stats["cycles"] > 0


def test_dspark_under_the_controlled_draft_source(dspark) -> None:
    """The efficiency bench's source wraps the drafter's chain steps too: at p = 1 every
    draft of every full cycle is accepted, and the output is mlx-lm's."""
    from melix_mlx.tools.controlled_draft import ControlledDraft

    model, head, _, _ = dspark
    want = reference(model, DSPARK_PROMPT, DSPARK_N)
    source = ControlledDraft(head, [DSPARK_PROMPT + want], head.markov_head.head.weight.shape[0], 1.0)
    got, decoder = mtp(model, source, DSPARK_PROMPT, DSPARK_N, 3)
    assert got == want and decoder.stats["accepted"] >= DSPARK_N - 4


def test_dspark_calibrates(dspark) -> None:
    """The device policy's calibration times its forwards on the spare layer caches (a
    plain LayerCache cannot be rolled back between timed runs): every timed forward runs
    twice and leaves the caches where it found them."""
    from melix_mlx.runtime.calibrate import build_forwards

    model, head, _, _ = dspark
    cache, head_cache = model.make_cache(), head.make_cache()
    forwards = build_forwards(model, head, k=2, cache=cache, head_cache=head_cache)
    offsets = [c.offset for c in cache], [c.offset for c in head_cache]
    for fn in forwards * 2:
        fn()
        assert ([c.offset for c in cache], [c.offset for c in head_cache]) == offsets


@pytest.mark.slow  # 1500 sampled runs: minutes on the 2-core CI machine
def test_dspark_sampled_tokens_follow_the_targets_joint(dspark) -> None:
    """temp 1, top_k 4, k = 1: the first two tokens (prefill, then one cycle whose draft is
    the drafter's block pass, biased toward the target's likeliest second token through
    its Markov head) are drawn from the target's exact joint (G-test, alpha 1e-3)."""
    from collections import Counter

    from melix_mlx.decode import MTPDecoder
    from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities
    from test_decode_sampling import ALPHA, SAMPLES, g_test

    model, head, _, _ = dspark
    vocab = head.markov_head.head.weight.shape[0]
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)

    def dist(tokens: list[int]) -> mx.array:
        return probabilities(normalize_logits(model(mx.array([tokens]))[0, -1]), params)

    p1 = dist(DSPARK_PROMPT)
    joint: dict[tuple[int, int], float] = {}
    table = mx.zeros((vocab, vocab))
    for t1 in (t for t in range(vocab) if p1[t].item() > 0):
        p2 = dist(DSPARK_PROMPT + [t1])
        joint.update({(t1, t2): p1[t1].item() * p2[t2].item() for t2 in range(vocab) if p2[t2].item() > 0})
        table = table.at[t1, int(mx.argmax(p2).item())].add(1e4)
    bigrams = _Bigrams([], vocab)
    bigrams.table = table
    original, head.markov_head = head.markov_head, bigrams
    mx.random.seed(20261207)
    counts: Counter = Counter()
    totals: Counter = Counter()
    try:
        for _ in range(SAMPLES):
            decoder = MTPDecoder(model, head, num_draft_tokens=1, sampler=sampler)
            t1, t2 = (t for t, _, _ in decoder.generate(mx.array(DSPARK_PROMPT), 2))
            counts[(t1, t2)] += 1
            totals.update({"accepted": decoder.stats["accepted"], "rejected": decoder.stats["rejected"]})
    finally:
        head.markov_head = original
    assert set(counts) <= set(joint)
    assert totals["accepted"] > SAMPLES // 10 and totals["rejected"] > SAMPLES // 10
    assert g_test(counts, joint) > ALPHA
