"""The sparse-attention (DSA) families: deepseek_v32 (DeepSeek-V3.2) and glm_moe_dsa (GLM-5).

On a tiny checkpoint written in each family's Hugging Face layout, with ``index_topk``
(6) below the contexts used, so the lightning indexer really drops keys:

- mlx-lm's own loader reads it, the project loader gives the same logits, the receipt
  admits the family with its own head module;
- the verify form (melix_mlx.runtime.dsa) equals mlx-lm's one-token decoding bit for bit
  at every position of a k + 1 block, caches included, where mlx-lm's own multi-token
  forward does not; batched rows (left-padded, with rolled-back holes) keep exactly the
  keys they keep alone, and padding never takes a top-k slot from a live key;
- the head's forward equals an independent reference written here from the published
  layout (plain mlx ops; tolerance 1e-4), and a swapped concatenation or the
  post-norm hidden chained instead of the pre-norm one is caught by it;
- greedy identity against mlx-lm single-sequence at k = 1..3 (random head, and a
  scripted head that gets drafts accepted) and batched (rows at k = 1, 2, 3, a late
  joiner, a removed row);
- after rejecting cycles the main cache (both parts of every layer's CacheList) equals
  a clean run fed only the confirmed tokens, bit for bit, with no replay forward;
  batched rows accepting all, some and nothing keep each row's two caches equal to a clean
  single run (1e-4);
- a two-layer head chains its second layer on a CacheList of its own (no fault);
- 4-bit weights keep identity; a quantized KV cache is refused typed (latent attention);
- sampled decoding draws the first two tokens from the target's exact joint (G-test as in
  test_decode_sampling; marked slow: ~150 s a family here).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import family_checks
import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.convert import convert
from melix_mlx.runtime import absorbed_mla, dsa, ragged_kv, rollback
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities
from melix_mlx.tools.tiny_dsa import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import CacheList, make_prompt_cache
from scripted_head import ScriptedHead
from test_decode_rollback import CYCLES, PROMPT, clean_cache, max_diff, run_cycles
from test_decode_sampling import ALPHA, SAMPLES, g_test

from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import Mode, ServingContext, resolve

N = 14
TOPK = 6
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]
LONG = [5, 17, 33, 2, 9, 41, 7, 100, 3, 44, 90, 12, 31]
BLOCK = [8, 72, 101, 108]
HF_HEAD_KEYS = [
    "model.layers.3.eh_proj.weight",
    "model.layers.3.shared_head.head.weight",
    "model.layers.3.self_attn.indexer.wq_b.weight",
    "model.layers.3.self_attn.indexer.k_norm.bias",
    "model.layers.3.self_attn.kv_b_proj.weight",
    "model.layers.3.mlp.experts.0.gate_proj.weight",
    "model.layers.0.self_attn.indexer.weights_proj.weight",
]


@pytest.fixture(scope="module")
def dsa_heads(tiny_checkpoint) -> dict[str, tuple]:
    return {f: (tiny_checkpoint(f), *load_with_heads(tiny_checkpoint(f))) for f in FAMILIES}


def _raw(path: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_layout_loads_with_mlx_lm_and_is_admitted(dsa_heads, family):
    path, _, _, head, _ = dsa_heads[family]
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["index_topk"] == TOPK and config["model_type"] == family
    # the head sits in model.safetensors: mlx-lm's sanitize drops it
    family_checks.hf_layout_admitted(dsa_heads[family], family, HF_HEAD_KEYS, PROMPTS[2])
    assert isinstance(head.make_cache()[0], CacheList)
    assert "indexer" in head.block.self_attn and "switch_mlp" in head.block.mlp


# -- the verify form -------------------------------------------------------------------------
def _prefilled(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    return cache


def _verify(model, block: list[list[int]], cache: list) -> mx.array:
    marked = absorbed_mla.arm(rollback.leaves(cache))
    try:
        return model(mx.array(block), cache=cache)
    finally:
        absorbed_mla.disarm(marked)


def _same_cache(a: list, b: list) -> bool:
    for x, y in zip(rollback.leaves(a), rollback.leaves(b), strict=True):
        n = x.offset
        if n != y.offset or not mx.array_equal(x.keys[..., :n, :], y.keys[..., :n, :]).item():
            return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_equals_one_token_decoding_bit_for_bit(dsa_heads, family):
    _, model, _, _, _ = dsa_heads[family]
    assert absorbed_mla.install(model) == 3  # every layer's DSA attention has its verify form
    plain_differs = False
    for plen in (2, 5, 9, 13):  # contexts below, at and past index_topk
        for L in (2, 4):
            stepped = _prefilled(model, LONG[:plen])
            one = mx.concatenate([model(mx.array([[t]]), cache=stepped)[:, 0] for t in BLOCK[:L]])
            verified = _prefilled(model, LONG[:plen])
            block = _verify(model, [BLOCK[:L]], verified)[0]
            assert mx.array_equal(one, block).item(), (plen, L)
            assert _same_cache(stepped, verified), (plen, L)
            plain = model(mx.array([BLOCK[:L]]), cache=_prefilled(model, LONG[:plen]))[0]
            plain_differs |= not mx.array_equal(one, plain).item()
    assert plain_differs  # mlx-lm's multi-token form (expanded attention) is not the decode's


def _batch_cache(model, prompts: list[list[int]]) -> list:
    return ragged_kv.adopt(_merge_caches([_prefilled(model, p) for p in prompts]))


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_keep_the_keys_they_keep_alone(dsa_heads, family, monkeypatch):
    """Left padding and a rolled-back hole: each row's top-k equals its own, padding never
    displaces a live key, and the rows' logits equal their own verify's."""
    _, model, _, _, _ = dsa_heads[family]
    absorbed_mla.install(model)
    kept: list[tuple[mx.array, mx.array | None, int]] = []
    real = dsa.top_keys

    def recording(q, keys, weights, row, k):
        top = real(q, keys, weights, row, k)
        kept.append((top, row, keys.shape[2]))
        return top

    monkeypatch.setattr(dsa, "top_keys", recording)
    prompts = [LONG[:4], LONG[:11]]
    cache = _batch_cache(model, prompts)
    _verify(model, [BLOCK[:3], BLOCK[1:4]], cache)
    rollback.drop_row_suffixes(cache, [2, 1])  # row 0 keeps 1, row 1 keeps 2: row 0 gets a hole
    batched = _verify(model, [BLOCK[:4], BLOCK[:4]], cache)
    batch_sel = [(t, r, s) for t, r, s in kept if t.shape[0] == 2][-12:]  # last verify: 3 layers x 4
    kept.clear()

    pad = [len(prompts[1]) - len(prompts[0]), 0]
    for b, (prompt, first) in enumerate(zip(prompts, ([8], [72, 101]))):
        alone = _prefilled(model, prompt)
        for t in first:  # the same kept tokens, decoded one by one
            model(mx.array([[t]]), cache=alone)
        kept.clear()
        base = alone[0][0].offset
        own = _verify(model, [BLOCK[:4]], alone)[0]
        assert mx.allclose(batched[b], own, atol=1e-4).item(), b
        skipped = sum(base + i + 1 <= TOPK for i in range(4))  # alone, these keep every key
        per_layer = 4 - skipped
        assert len(kept) == 3 * per_layer
        for n, (top_b, row_b, _) in enumerate(batch_sel):
            layer, i = divmod(n, 4)
            live = row_b[b, 0, 0]
            chosen = top_b[b, 0, 0]
            picked_live = mx.take(live, chosen).astype(mx.int32).sum().item()
            assert picked_live == min(TOPK, live.astype(mx.int32).sum().item())  # no padding in a top-k
            # batched positions -> the row's own: drop its padding, close its hole
            positions = [p - pad[b] for p in sorted(chosen.tolist()) if live[p].item()]
            if b == 0:
                hole = len(prompts[0]) + 1  # the second token of its first verify was rolled back
                positions = [p - (p > hole) for p in positions if p != hole]
            if i < skipped:
                assert positions == list(range(base + i + 1)), (b, layer, i)
            else:
                own_top = kept[layer * per_layer + i - skipped][0]
                assert positions == sorted(own_top[0, 0, 0].tolist()), (b, layer, i)


# -- the head against an independent reference ------------------------------------------------
def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope(x: mx.array, dims: int, base: float, interleaved: bool) -> mx.array:
    """RoPE at positions 0..L-1 on the first `dims` features of x [..., L, d]."""
    L = x.shape[-2]
    inv = base ** (-mx.arange(0, dims, 2).astype(mx.float32) / dims)
    ang = mx.arange(L).astype(mx.float32)[:, None] * inv[None]
    cos, sin = mx.cos(ang), mx.sin(ang)
    r, rest = x[..., :dims], x[..., dims:]
    if interleaved:
        a, b = r[..., 0::2], r[..., 1::2]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(r.shape)
    else:
        a, b = r[..., : dims // 2], r[..., dims // 2 :]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([out, rest], axis=-1)


def _swiglu(w: dict, p: str, x: mx.array) -> mx.array:
    gate, up = x @ w[f"{p}.gate_proj.weight"].T, x @ w[f"{p}.up_proj.weight"].T
    return (gate * mx.sigmoid(gate) * up) @ w[f"{p}.down_proj.weight"].T


def _reference_head(
    w: dict, c: dict, p: str, embed: mx.array, hidden: mx.array, tokens: mx.array, *, swap=False
):
    """(pre-norm output [L, D], logits [L, V]) of MTP layer `p` over one sequence of pairs,
    from the published DeepSeek-V3.2 / GLM-5 layout (expanded attention, no cache)."""
    eps, L = c["rms_norm_eps"], hidden.shape[0]
    e = _rms(embed[tokens], w[f"{p}.enorm.weight"], eps)
    h = _rms(hidden, w[f"{p}.hnorm.weight"], eps)
    x = mx.concatenate([h, e] if swap else [e, h], axis=-1) @ w[f"{p}.eh_proj.weight"].T
    a = f"{p}.self_attn"
    y = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
    H, vd = c["num_attention_heads"], c["v_head_dim"]
    nope, rope = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    theta = c["rope_parameters"]["rope_theta"] if "rope_parameters" in c else c["rope_theta"]
    qr = _rms(y @ w[f"{a}.q_a_proj.weight"].T, w[f"{a}.q_a_layernorm.weight"], 1e-6)
    q = (qr @ w[f"{a}.q_b_proj.weight"].T).reshape(L, H, nope + rope).transpose(1, 0, 2)
    q = mx.concatenate([q[..., :nope], _rope(q[..., nope:], rope, theta, True)], axis=-1)
    ckv = y @ w[f"{a}.kv_a_proj_with_mqa.weight"].T
    latent = _rms(ckv[:, : c["kv_lora_rank"]], w[f"{a}.kv_a_layernorm.weight"], 1e-6)
    k_pe = _rope(ckv[None, :, c["kv_lora_rank"] :], rope, theta, True)
    kv = (latent @ w[f"{a}.kv_b_proj.weight"].T).reshape(L, H, nope + vd).transpose(1, 0, 2)
    k = mx.concatenate([kv[..., :nope], mx.broadcast_to(k_pe, (H, L, rope))], axis=-1)
    # lightning indexer: relu(q_h . k) weighted per head, top-k over the causal prefix
    nh, hd = c["index_n_heads"], c["index_head_dim"]
    interleave = c.get("indexer_rope_interleave", False)
    iq = (qr @ w[f"{a}.indexer.wq_b.weight"].T).reshape(L, nh, hd).transpose(1, 0, 2)
    iq = _rope(iq, rope, theta, interleave)
    ik = y @ w[f"{a}.indexer.wk.weight"].T
    mu, var = ik.mean(axis=-1, keepdims=True), ik.var(axis=-1, keepdims=True)
    ik = (ik - mu) * mx.rsqrt(var + 1e-5) * w[f"{a}.indexer.k_norm.weight"] + w[f"{a}.indexer.k_norm.bias"]
    ik = _rope(ik[None], rope, theta, interleave)
    gate = (y @ w[f"{a}.indexer.weights_proj.weight"].T) * (nh**-0.5 * hd**-0.5)  # [L, nh]
    index = (mx.maximum(iq @ ik.swapaxes(-1, -2), 0) * gate.T[:, :, None]).sum(axis=0)  # [L, L]
    allowed = []
    for i in range(L):
        if i + 1 <= c["index_topk"]:
            allowed.append([j <= i for j in range(L)])
        else:
            ranked = sorted(range(i + 1), key=lambda j: -index[i, j].item())
            keep = set(ranked[: c["index_topk"]])
            allowed.append([j in keep for j in range(L)])
    mask = mx.array(allowed)
    scores = (q @ k.swapaxes(-1, -2)) * (nope + rope) ** -0.5
    probs = mx.softmax(mx.where(mask, scores, -mx.inf), axis=-1)
    attn = (probs @ kv[..., nope:]).transpose(1, 0, 2).reshape(L, H * vd) @ w[f"{a}.o_proj.weight"].T
    x = x + attn
    y = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    logits_e = y @ w[f"{p}.mlp.gate.weight"].T
    probs_e = mx.sigmoid(logits_e)
    biased = probs_e + w[f"{p}.mlp.gate.e_score_correction_bias"]  # the bias only routes
    chosen = mx.argsort(-biased, axis=-1)[:, : c["num_experts_per_tok"]]
    moe = []
    for i in range(L):
        picks = chosen[i].tolist()
        gates = mx.stack([probs_e[i, e] for e in picks])
        gates = gates / gates.sum() * c["routed_scaling_factor"]
        moe.append(sum(g * _swiglu(w, f"{p}.mlp.experts.{e}", y[i]) for g, e in zip(gates, picks)))
    x = x + mx.stack(moe) + _swiglu(w, f"{p}.mlp.shared_experts", y)
    logits = _rms(x, w[f"{p}.shared_head.norm.weight"], eps) @ w[f"{p}.shared_head.head.weight"].T
    return x, logits


@pytest.mark.parametrize("family", FAMILIES)
def test_head_forward_matches_independent_reference(dsa_heads, family):
    path, model, _, head, _ = dsa_heads[family]
    c = json.loads((Path(path) / "config.json").read_text())
    w = _raw(path)
    p = f"model.layers.{c['num_hidden_layers']}"
    seq = mx.array([LONG])
    _, hidden = forward_with_hidden(model, seq, make_prompt_cache(model))
    hid, toks = hidden[0, :-1], seq[0, 1:]  # 12 pairs: queries past index_topk drop keys
    want_out, want_logits = _reference_head(w, c, p, w["model.embed_tokens.weight"], hid, toks)
    logits, out = head(hid[None], toks[None], head.make_cache())
    assert mx.abs(out[0] - want_out).max().item() < 1e-4
    assert mx.abs(logits[0] - want_logits).max().item() < 1e-4
    # the comparison is sharp: a swapped concatenation is far outside the tolerance
    swapped, _ = _reference_head(w, c, p, w["model.embed_tokens.weight"], hid, toks, swap=True)
    assert mx.abs(out[0] - swapped).max().item() > 1e-2
    # depth 2 chains the pre-norm output (not the shared_head.norm output)
    step2_logits, step2_out = head(out[:, :1], toks[None, 1:2], head.make_cache())
    ref2_out, ref2_logits = _reference_head(w, c, p, w["model.embed_tokens.weight"], want_out[:1], toks[1:2])
    assert mx.abs(step2_logits[0] - ref2_logits).max().item() < 1e-4
    normed = _rms(want_out[:1], w[f"{p}.shared_head.norm.weight"], c["rms_norm_eps"])
    wrong, _ = _reference_head(w, c, p, w["model.embed_tokens.weight"], normed, toks[1:2])
    assert mx.abs(step2_out[0] - wrong).max().item() > 1e-2
    assert mx.abs(step2_out[0] - ref2_out).max().item() < 1e-4


# -- greedy identity --------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_single(dsa_heads, family):
    _, model, _, head, _ = dsa_heads[family]
    dim = main_parts(model).args.hidden_size
    refs = [reference(model, prompt, N) for prompt in PROMPTS]
    longer = reference(model, PROMPTS[0], N + 8)
    scripted = ScriptedHead([PROMPTS[0] + longer], VOCAB_SIZE, dim, wrong_every=4)
    for k in (1, 2, 3):
        for i, (prompt, want) in enumerate(zip(PROMPTS, refs)):
            got, decoder = mtp(model, head, prompt, N, k)
            assert got == want, (family, k, i)
            assert decoder.stats["faults"] == 0 and decoder.stats["refusal"] is None
            assert decoder.stats["cycles"] > 0
        # drafts that get accepted: the emitted verify positions past the first
        got, decoder = mtp(model, scripted, PROMPTS[0], N, k)
        assert got == longer[:N], (family, k)
        assert decoder.stats["accepted"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_batched(dsa_heads, family):
    _, model, _, head, _ = dsa_heads[family]
    dim = main_parts(model).args.hidden_size
    late = LONG[:9]
    refs = [reference(model, p, N) for p in PROMPTS + [late]]
    scripted = ScriptedHead([p + r for p, r in zip(PROMPTS + [late], refs)], VOCAB_SIZE, dim, wrong_every=3)
    for drafter in (head, scripted):
        gen = MTPBatchGenerator(model, drafter, max_tokens=N)
        assert gen.refusal is None
        uids = gen.insert(PROMPTS, num_draft_tokens=[1, 2, 3])
        out: dict[int, list[int]] = {}
        late_uid = None
        for step in range(300):
            if not (gen.batch.uids or gen._queue):
                break
            if step == 3:
                late_uid = gen.insert([late], num_draft_tokens=[2])[0]  # joins mid-run
            if step == 5:
                gen.remove([uids[1]])  # leaves mid-run
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
        assert out[uids[0]] == refs[0] and out[uids[2]] == refs[2]
        assert out[uids[1]] == refs[1][: len(out[uids[1]])]
        assert out[late_uid] == refs[3]
        assert gen.speculative_stats()["cycles"] > 0


# -- rollback ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_cache_equals_clean_run(dsa_heads, family, monkeypatch):
    _, model, _, head, _ = dsa_heads[family]
    script = PROMPT + reference(model, PROMPT, 40)
    scripted = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    for name, drafter, k in (("partial", scripted, 3), ("random", head, 2)):
        decoder, kept, _ = run_cycles(model, drafter, k, monkeypatch)
        assert decoder.stats["rollbacks"] == CYCLES, name
        assert all(len(c.caches) == 2 for c in decoder.cache)  # CacheList(latent, indexer)
        tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
        assert max_diff(decoder.cache, tokenwise) == 0.0, name
        assert decoder.stats["replay_forwards"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_roll_back_both_caches_in_isolation(dsa_heads, family):
    """Rows accepting all, some and nothing share verify steps; each row's CacheList
    (latent and indexer keys) then equals a clean single-sequence run over its tokens."""
    _, model, _, _, _ = dsa_heads[family]
    prompts = [PROMPTS[0], PROMPTS[1], LONG[:9]]
    refs = [reference(model, p, N + 6) for p in prompts]
    dim = main_parts(model).args.hidden_size
    exact = ScriptedHead([prompts[0] + refs[0]], VOCAB_SIZE, dim)
    wrong = ScriptedHead([prompts[1] + refs[1]], VOCAB_SIZE, dim, wrong_every=3)
    row1, right = tuple(prompts[1][1:]), exact.predict

    def predict(prefix):  # row 0 exact, row 1 wrong every third position, row 2 unscripted
        return wrong.predict(prefix) if tuple(prefix[: len(row1)]) == row1 else right(prefix)

    exact.predict = predict
    gen = MTPBatchGenerator(model, exact, num_draft_tokens=3, max_tokens=N + 6)
    uids = gen.insert(prompts)
    for _ in range(4):
        gen.next()
    rates = [row.counters.acceptance_rate for row in gen.batch]
    assert rates[0] == 1.0 and 0.0 < rates[1] < 1.0 and rates[2] == 0.0
    for uid, (cache, context) in gen.extract_cache(set(uids)).items():
        clean = make_prompt_cache(model)
        model(mx.array([context[:-1]]), cache=clean)
        model(mx.array([context[-1:]]), cache=clean)
        for got, want in zip(rollback.leaves(cache), rollback.leaves(clean), strict=True):
            n = want.offset
            assert got.offset == n, uid
            assert mx.allclose(got.keys[..., :n, :], want.keys[..., :n, :], atol=1e-4).item(), uid


# -- quantized weights --------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_weights_keep_identity(dsa_heads, family, tmp_path):
    path = dsa_heads[family][0]
    out = convert(path, tmp_path / f"{family}-q4", quantize=True, q_group_size=32)
    model, _, head, info = load_with_heads(out)
    assert info.main_quantized
    for k in (1, 3):
        want = reference(model, PROMPTS[2], N)
        got, decoder = mtp(model, head, PROMPTS[2], N, k)
        assert got == want and decoder.stats["cycles"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_kv_cache_is_refused_typed(dsa_heads, family):
    """The latent cache is read as plain arrays: kv_bits is refused, the family is not."""
    path = dsa_heads[family][0]
    receipt = resolve(path, speculative_config(), context=ServingContext(quantized_kv=True))
    assert receipt.mode is Mode.refused and receipt.refusal_reason is RefusalReason.unsupported_quantization
    plain = resolve(path, speculative_config())
    assert plain.mode is Mode.accepted and [c.kind for c in plain.caches] == ["kv"]


# -- sampling ---------------------------------------------------------------------------------
SAMPLED_PROMPT = LONG[:8]  # the first cycle's verify runs past index_topk


@pytest.mark.slow  # ~150 s a family on the 2-core CI machine
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_tokens_follow_the_targets_joint(dsa_heads, family):
    """temp 1, top_k 4: the first two tokens (prefill, then one k = 1 cycle whose verify
    selects keys) are drawn from the target's exact joint (G-test, alpha 1e-3)."""
    model = dsa_heads[family][1]
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)

    def dist(tokens: list[int]) -> mx.array:
        return probabilities(normalize_logits(model(mx.array([tokens]))[0, -1]), params)

    p1 = dist(SAMPLED_PROMPT)
    joint: dict[tuple[int, int], float] = {}
    scripts = []
    for t1 in (t for t in range(VOCAB_SIZE) if p1[t].item() > 0):
        p2 = dist(SAMPLED_PROMPT + [t1])
        joint.update(
            {(t1, t2): p1[t1].item() * p2[t2].item() for t2 in range(VOCAB_SIZE) if p2[t2].item() > 0}
        )
        scripts.append(SAMPLED_PROMPT + [t1, int(mx.argmax(p2).item())])
    head = ScriptedHead(scripts, VOCAB_SIZE, main_parts(model).args.hidden_size, confidence=2.0)
    mx.random.seed(20261206)
    counts: Counter = Counter()
    totals: Counter = Counter()
    for _ in range(SAMPLES):
        decoder = MTPDecoder(model, head, num_draft_tokens=1, sampler=sampler)
        t1, t2 = (t for t, _, _ in decoder.generate(mx.array(SAMPLED_PROMPT), 2))
        counts[(t1, t2)] += 1
        totals.update({"accepted": decoder.stats["accepted"], "rejected": decoder.stats["rejected"]})
    assert set(counts) <= set(joint)
    assert totals["accepted"] > SAMPLES // 10 and totals["rejected"] > SAMPLES // 10
    assert g_test(counts, joint) > ALPHA


def test_two_layer_head_chains_on_its_own_dsa_caches(tiny_checkpoint):
    """num_nextn_predict_layers = 2: draft step 2 runs layer 1 on a CacheList of its own."""
    model, _, head, _ = load_with_heads(tiny_checkpoint("deepseek_v32", mtp_layers=2))
    assert len(head.heads) == 2
    want = reference(model, PROMPTS[0], N)
    for k in (2, 3):
        got, decoder = mtp(model, head, PROMPTS[0], N, k)
        assert got == want and decoder.stats["faults"] == 0 and decoder.stats["cycles"] > 0
