"""Ling V3 (bailing_moe_v3) and Ling 2.5 (bailing_hybrid): linear-attention hybrids with a
DeepSeek-style MTP head, on tiny checkpoints in the HF layout.

For each family:
- mlx-lm's own loader reads the main model, the project loader yields the same logits,
  the receipt admits the family with its own head module, names its caches (KV trimmed,
  linear-attention state captured and selected) and refuses a quantized KV cache typed;
- the head's forward equals a reference forward written here from the published
  architecture (vLLM's bailing_moe_v3_mtp / bailing_mtp) with plain mlx ops on the raw HF
  tensors: expanded latent attention with interleaved RoPE (and Ling V3's per-head output
  gate), sigmoid group-limited routing with expert bias and shared experts,
  ``final_layernorm`` (Ling 2.5: then ``shared_head.norm``) before the main lm_head
  (float32, tolerance 1e-3 on logits of scale ~10: a wrong norm, a swapped concatenation,
  a missing final norm or the wrong hidden state moves them by O(1));
- greedy MTP decoding equals mlx-lm's greedy output token for token, single sequence at
  k = 1..3 (one prompt under a repetition penalty) and batched (rows at k = 1, 2, 3, a
  row removed mid-run, a late joiner);
- after rejecting cycles the main cache equals a clean run fed only the confirmed tokens
  one by one, bit for bit: the linear-attention states selected from the verify's capture
  (melix_mlx.runtime.capture_linear), the latent caches trimmed after an absorbed verify
  (melix_mlx.runtime.absorbed_bailing), no replay forward;
- a 4-bit converted checkpoint keeps identity;
- (slow) sampled decoding draws the first two tokens from the target's exact joint.
A Ling V3 checkpoint published under ``model_type = "bailing_hybrid"`` (architecture
``BailingMoeV3ForCausalLM``, which mlx-lm loads as bailing_moe_v3) gets the Ling V3 head.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import family_checks
import mlx.core as mx
import mlx_lm
import pytest
from decode_refs import mtp, reference
from melix_mlx.decode import MTPDecoder
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.heads import bailing_moe_v3
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities
from melix_mlx.tools.tiny_linear import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from scripted_head import ScriptedHead
from test_decode_rollback import CYCLES, PROMPT, clean_cache, max_diff, run_cycles
from test_decode_sampling import ALPHA, SAMPLES, g_test

from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import Mode, ServingContext, resolve

N = 14
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]
LATE = [60, 61, 62, 63, 64]

HF_HEAD_KEYS = {
    "bailing_moe_v3": [
        "model.layers.4.enorm.weight",
        "model.layers.4.hnorm.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.4.final_layernorm.weight",
        "model.layers.4.attention.kv_b_proj.weight",
        "model.layers.4.attention.g_proj.weight",
        "model.layers.4.mlp.experts.0.gate_proj.weight",
        "model.layers.4.mlp.gate.expert_bias",
        "model.layers.0.attention.q_conv1d.weight",
    ],
    "bailing_hybrid": [
        "model.layers.4.enorm.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.4.final_layernorm.weight",
        "model.layers.4.shared_head.norm.weight",
        "model.layers.4.attention.kv_b_proj.weight",
        "model.layers.4.mlp.experts.0.gate_proj.weight",
        "model.layers.0.attention.query_key_value.weight",
        "model.layers.0.attention.g_norm.weight",
    ],
}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint) -> dict[str, tuple]:
    return {f: (tiny_checkpoint(f), *load_with_heads(tiny_checkpoint(f))) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_layout_loads_with_mlx_lm_and_is_admitted(loaded, family):
    model = loaded[family][1]
    family_checks.hf_layout_admitted(loaded[family], family, HF_HEAD_KEYS[family], PROMPTS[2])
    assert [type(c) for c in make_prompt_cache(model)] == [ArraysCache, mlx_lm.models.cache.KVCache] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_receipt_names_the_caches_and_refuses_a_quantized_kv_cache_typed(loaded, family):
    """Latent attention reads its cache as plain arrays: kv_bits is refused, the family is not."""
    path = loaded[family][0]
    plain = resolve(path, speculative_config())
    assert plain.mode is Mode.accepted
    kinds = sorted((c.kind, c.strategy) for c in plain.caches)
    assert kinds == [("arrays", "capture_select"), ("kv", "trim")]
    receipt = resolve(path, speculative_config(), context=ServingContext(quantized_kv=True))
    assert receipt.mode is Mode.refused and receipt.refusal_reason is RefusalReason.unsupported_quantization


def test_ling_2_5_head_without_its_shared_head_norm_is_refused_typed(loaded, tmp_path):
    from melix_mlx.loading.errors import MissingHeadWeights

    path = shutil.copytree(loaded["bailing_hybrid"][0], tmp_path / "no-norm")
    weights = mx.load(str(path / "model.safetensors"))
    del weights["model.layers.4.shared_head.norm.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    with pytest.raises(MissingHeadWeights, match="shared_head.norm.weight"):
        load_with_heads(path)


def test_ling_v3_under_the_bailing_hybrid_model_type_gets_the_ling_v3_head(loaded, tmp_path):
    path = shutil.copytree(loaded["bailing_moe_v3"][0], tmp_path / "ling3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "bailing_hybrid"}))
    model, _, head, info = load_with_heads(path)
    assert info.family == "bailing_hybrid" and type(head) is bailing_moe_v3.MTPHead
    want = reference(model, PROMPTS[0], N)
    got, decoder = mtp(model, head, PROMPTS[0], N, 2)
    assert got == want and decoder.stats["cycles"] > 0


# -- the reference forwards ------------------------------------------------------------------
def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: mx.array, base: float) -> mx.array:
    """Interleaved RoPE (pairs 2i, 2i + 1) from position 0 over x [B, H, L, d]."""
    d, length = x.shape[-1], x.shape[-2]
    inv = base ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)
    ang = mx.arange(length, dtype=mx.float32)[:, None] * inv[None]
    cos, sin = mx.cos(ang), mx.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    return mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


def _mlp(w: dict, p: str, x: mx.array) -> mx.array:
    g = x @ w[f"{p}.gate_proj.weight"].T
    return (g * mx.sigmoid(g) * (x @ w[f"{p}.up_proj.weight"].T)) @ w[f"{p}.down_proj.weight"].T


def _mla(w: dict, c: dict, s: str, a: mx.array, gated: bool) -> mx.array:
    """Latent attention in its expanded form (kv_b_proj up-projects every latent)."""
    eps, H = c["rms_norm_eps"], c["num_attention_heads"]
    nope, rope, vd, kvr = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    B, L, _ = a.shape
    q = _rms(a @ w[f"{s}.q_a_proj.weight"].T, w[f"{s}.q_a_layernorm.weight"], eps)
    q = q @ w[f"{s}.q_b_proj.weight"].T
    q = q.reshape(B, L, H, nope + rope).transpose(0, 2, 1, 3)
    kv = a @ w[f"{s}.kv_a_proj_with_mqa.weight"].T
    latent = _rms(kv[..., :kvr], w[f"{s}.kv_a_layernorm.weight"], eps)
    k_pe = _rope(kv[..., None, kvr:].transpose(0, 2, 1, 3), c["rope_theta"])  # [B, 1, L, rope]
    up = w[f"{s}.kv_b_proj.weight"].reshape(H, nope + vd, kvr)
    k_nope = latent[:, None] @ up[:, :nope].swapaxes(-1, -2)[None]  # [B, H, L, nope]
    v = latent[:, None] @ up[:, nope:].swapaxes(-1, -2)[None]
    q_pe = _rope(q[..., nope:], c["rope_theta"])
    scores = q[..., :nope] @ k_nope.swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2)
    causal = mx.tril(mx.ones((L, L), dtype=mx.bool_))
    p = mx.softmax(mx.where(causal, scores / math.sqrt(nope + rope), -1e30), axis=-1)
    o = (p @ v).transpose(0, 2, 1, 3)  # [B, L, H, vd]
    if gated:  # Ling V3: a sigmoid gate per head on the attention output
        o = o * mx.sigmoid(a @ w[f"{s}.g_proj.weight"].T)[..., None]
    return o.reshape(B, L, -1) @ w[f"{s}.dense.weight"].T


def _moe(w: dict, c: dict, p: str, x: mx.array) -> mx.array:
    """Sigmoid scores; expert bias and group limits choose, raw scores weigh (renormalised)."""
    E, G = c["num_experts"], c["n_group"]
    scores = mx.sigmoid(x @ w[f"{p}.gate.weight"].T)
    choose = (scores + w[f"{p}.gate.expert_bias"]).reshape(*x.shape[:-1], G, E // G)
    group = mx.sort(choose, axis=-1)[..., -2:].sum(axis=-1)  # [B, L, G]
    keep = group >= mx.sort(group, axis=-1)[..., -c["topk_group"]][..., None]
    choose = mx.where(keep[..., None], choose, -mx.inf).reshape(*x.shape[:-1], E)
    picked = choose >= mx.sort(choose, axis=-1)[..., -c["num_experts_per_tok"]][..., None]
    weight = mx.where(picked, scores, 0.0)
    weight = weight / (weight.sum(axis=-1, keepdims=True) + 1e-20) * c["routed_scaling_factor"]
    routed = sum(weight[..., e : e + 1] * _mlp(w, f"{p}.experts.{e}", x) for e in range(E))
    return routed + _mlp(w, f"{p}.shared_experts", x)


def _reference(w: dict, c: dict, family: str, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, ...]:
    eps, p = c["rms_norm_eps"], f"model.layers.{c['num_hidden_layers']}"
    e = _rms(w["model.word_embeddings.weight"][tokens], w[f"{p}.enorm.weight"], eps)
    h = _rms(hidden, w[f"{p}.hnorm.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ w[f"{p}.eh_proj.weight"].T  # embedding first
    a = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
    x = x + _mla(w, c, f"{p}.attention", a, gated=family == "bailing_moe_v3")
    x = x + _moe(w, c, f"{p}.mlp", _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps))
    out = _rms(x, w[f"{p}.final_layernorm.weight"], eps)  # the layer's output: what chains
    if family == "bailing_hybrid":  # deepseek_mtp's shared head: its norm, then the matrix
        return _rms(out, w[f"{p}.shared_head.norm.weight"], eps) @ w["lm_head.weight"].T, out
    return out @ w["lm_head.weight"].T, out


@pytest.mark.parametrize("family", FAMILIES)
def test_head_forward_matches_the_published_architecture(loaded, family):
    path, model, _, head, _ = loaded[family]
    raw: dict[str, mx.array] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    config = json.loads((path / "config.json").read_text())
    x = mx.array([PROMPTS[2]])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    got_logits, got_hidden = head(hidden[:, :-1], x[:, 1:], head.make_cache())
    want_logits, want_hidden = _reference(raw, config, family, hidden[:, :-1], x[:, 1:])
    assert mx.abs(want_logits).max().item() > 1.0  # a real signal to compare
    assert mx.abs(got_logits - want_logits).max().item() < 1e-3
    assert mx.abs(got_hidden - want_hidden).max().item() < 1e-3


# -- identity and rollback -------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_single(loaded, family, k):
    _, model, _, head, _ = loaded[family]
    for decoder in family_checks.greedy_identity_single(model, head, PROMPTS, N, k):
        assert decoder.stats["replay_forwards"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_batched_with_removal_and_late_joiner(loaded, family):
    _, model, _, head, _ = loaded[family]
    family_checks.batched_identity(model, head, PROMPTS, LATE, N)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_cache_equals_clean_run(loaded, family, monkeypatch):
    _, model, _, head, _ = loaded[family]
    family_checks.rollback_equals_clean_run(model, head, monkeypatch)


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_identity(loaded, family, tmp_path):
    family_checks.four_bit_identity(loaded[family][0], family, tmp_path, PROMPTS[::2], N)


def test_ring_linear_target_rolls_back_exactly(monkeypatch):
    """Ring/Ling linear 2.0 (bailing_moe_linear: no MTP head of its own, a draft source in the
    head slot) keeps greedy identity, and its lightning state is selected from the verify's
    capture: the cache equals a clean run fed the confirmed tokens one by one, bit for bit."""
    from melix_mlx.tools.tiny_linear import CONFIGS
    from mlx_lm.models import bailing_moe_linear

    mx.random.seed(3)
    config = {**CONFIGS["bailing_hybrid"], "model_type": "bailing_moe_linear", "head_dim": None}
    model = bailing_moe_linear.Model(bailing_moe_linear.ModelArgs.from_dict(config))
    model.update(
        {"lm_head": {"weight": mx.random.normal(model.lm_head.weight.shape, key=mx.random.key(4)) * 0.5}}
    )
    mx.eval(model.parameters())
    hidden = main_parts(model).args.hidden_size
    script = PROMPT + reference(model, PROMPT, 40)
    for k in (1, 3):
        drafter = ScriptedHead([script], VOCAB_SIZE, hidden, wrong_every=3)
        got, decoder = mtp(model, drafter, PROMPT, N, k)
        assert got == script[len(PROMPT) : len(PROMPT) + N] and decoder.stats["rollbacks"] > 0
    drafter = ScriptedHead([script], VOCAB_SIZE, hidden, wrong_every=3)
    decoder, kept, _ = run_cycles(model, drafter, 3, monkeypatch)
    assert decoder.stats["rollbacks"] == CYCLES and decoder.stats["replay_forwards"] == 0
    tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
    assert max_diff(decoder.cache, tokenwise) == 0.0


# -- sampling ---------------------------------------------------------------------------------
@pytest.mark.slow  # 1,500 decoder runs a family
@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_tokens_follow_the_targets_joint(loaded, family):
    """temp 1, top_k 4: the first two tokens (prefill, then one k = 1 cycle: a scripted soft
    draft accepted with min(1, p/q), else a residual draw, the linear state selected at the
    accepted length) are drawn from the target's exact joint (G-test, alpha 1e-3)."""
    model = loaded[family][1]
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)
    prompt = PROMPTS[0]

    def dist(tokens: list[int]) -> mx.array:
        return probabilities(normalize_logits(model(mx.array([tokens]))[0, -1]), params)

    p1 = dist(prompt)
    joint: dict[tuple[int, int], float] = {}
    scripts = []
    for t1 in (t for t in range(VOCAB_SIZE) if p1[t].item() > 0):
        p2 = dist(prompt + [t1])
        allowed = [t2 for t2 in range(VOCAB_SIZE) if p2[t2].item() > 0]
        joint.update({(t1, t2): p1[t1].item() * p2[t2].item() for t2 in allowed})
        scripts.append(prompt + [t1, int(mx.argmax(p2).item())])
    head = ScriptedHead(scripts, VOCAB_SIZE, main_parts(model).args.hidden_size, confidence=2.0)
    mx.random.seed(20261206)
    counts: Counter = Counter()
    totals: Counter = Counter()
    for _ in range(SAMPLES):
        decoder = MTPDecoder(model, head, num_draft_tokens=1, sampler=sampler)
        t1, t2 = (t for t, _, _ in decoder.generate(mx.array(prompt), 2))
        counts[(t1, t2)] += 1
        totals.update({"accepted": decoder.stats["accepted"], "rejected": decoder.stats["rejected"]})
    assert set(counts) <= set(joint)
    assert totals["accepted"] > SAMPLES // 10 and totals["rejected"] > SAMPLES // 10
    assert g_test(counts, joint) > ALPHA
