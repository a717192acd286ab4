"""ERNIE-4.5 MoE and LongCat-Flash: their MTP heads, on tiny checkpoints in the HF layout.

For each family:
- mlx-lm's own loader reads the main model, the project loader yields the same logits,
  the receipt admits the family with its own head module (LongCat: with no head-count
  key in the config, one head layer by default);
- the head's forward equals a reference forward written here from the published
  architecture with plain mlx ops on the raw HF tensors (float32, tolerance 1e-3 on
  logits of scale ~10: a wrong norm convention, a swapped concatenation, a missing final
  norm or the wrong hidden state moves them by O(1));
- greedy MTP decoding equals mlx-lm's greedy output token for token, single sequence at
  k = 1..3 (one prompt under a repetition penalty) and batched (rows at k = 1, 2, 3, a
  row removed mid-run, a late joiner);
- after rejecting cycles the main cache equals a clean run fed only the confirmed tokens
  (LongCat: both latent caches of every layer, CacheList(KVCache, KVCache)), no replay;
- a 4-bit converted checkpoint keeps identity.
LongCat-Flash's n-gram variant has its own file, test_family_longcat_ngram.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import family_checks
import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.tools.tiny_ernie_longcat import FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import CacheList, make_prompt_cache
from scripted_head import ScriptedHead

from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import resolve

N = 14
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]
LATE = [60, 61, 62, 63, 64]

HF_HEAD_KEYS = {
    "ernie4_5_moe": [
        "model.mtp_emb_norm.0.weight",
        "model.mtp_hidden_norm.0.weight",
        "model.mtp_linear_proj.0.weight",
        "model.mtp_block.0.self_attn.q_proj.weight",
        "model.mtp_block.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.moe_statics.e_score_correction_bias",
    ],
    "longcat_flash": [
        "model.mtp.embed_tokens.weight",
        "model.mtp.layers.0.enorm.m.weight",
        "model.mtp.layers.0.hnorm.m.weight",
        "model.mtp.layers.0.eh_proj.weight",
        "model.mtp.layers.0.self_attn.kv_b_proj.weight",
        "model.mtp.layers.0.transformer_layer.mlp.down_proj.weight",
        "model.mtp.norm.weight",
        "model.layers.0.self_attn.1.kv_b_proj.weight",
        "model.layers.0.mlp.router.classifier.weight",
    ],
}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint) -> dict[str, tuple]:
    return {f: (tiny_checkpoint(f), *load_with_heads(tiny_checkpoint(f))) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_layout_loads_with_mlx_lm_and_is_admitted(loaded, family):
    path, model = loaded[family][:2]
    family_checks.hf_layout_admitted(loaded[family], family, HF_HEAD_KEYS[family], PROMPTS[2])
    if family == "longcat_flash":
        assert "num_nextn_predict_layers" not in json.loads((path / "config.json").read_text())
        assert all(isinstance(c, CacheList) for c in make_prompt_cache(model))


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


def _attend(scores: mx.array, v: mx.array) -> mx.array:
    length = scores.shape[-1]
    causal = mx.tril(mx.ones((length, length), dtype=mx.bool_))
    p = mx.softmax(mx.where(causal, scores, -1e30), axis=-1)
    return p @ v  # [B, H, L, dv]


def _mlp(w: dict, p: str, x: mx.array) -> mx.array:
    g = x @ w[f"{p}.gate_proj.weight"].T
    return (g * mx.sigmoid(g) * (x @ w[f"{p}.up_proj.weight"].T)) @ w[f"{p}.down_proj.weight"].T


def _ernie_reference(w: dict, c: dict, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    eps, H, KV, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    e = _rms(w["model.embed_tokens.weight"][tokens], w["model.mtp_emb_norm.0.weight"], eps)
    h = _rms(hidden, w["model.mtp_hidden_norm.0.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ w["model.mtp_linear_proj.0.weight"].T
    p = "model.mtp_block.0"
    a = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
    B, L, _ = a.shape

    def heads(name: str, n: int) -> mx.array:
        return (a @ w[f"{p}.self_attn.{name}.weight"].T).reshape(B, L, n, hd).transpose(0, 2, 1, 3)

    q, k, v = (
        _rope(heads("q_proj", H), c["rope_theta"]),
        _rope(heads("k_proj", KV), c["rope_theta"]),
        heads("v_proj", KV),
    )
    k, v = mx.repeat(k, H // KV, axis=1), mx.repeat(v, H // KV, axis=1)
    o = _attend((q @ k.swapaxes(-1, -2)) / math.sqrt(hd), v).transpose(0, 2, 1, 3).reshape(B, L, -1)
    x = x + o @ w[f"{p}.self_attn.o_proj.weight"].T
    x = x + _mlp(w, f"{p}.mlp", _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps))
    # the shared final norm, then the shared lm_head; the block output is what chains
    return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T, x


def _longcat_reference(w: dict, c: dict, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
    eps, H, D = c["rms_norm_eps"], c["num_attention_heads"], c["hidden_size"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    p = "model.mtp.layers.0"
    e = _rms(w["model.mtp.embed_tokens.weight"][tokens], w[f"{p}.enorm.m.weight"], eps)
    h = _rms(hidden, w[f"{p}.hnorm.m.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ w[f"{p}.eh_proj.weight"].T
    a = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
    B, L, _ = a.shape
    s = f"{p}.self_attn"
    q = (
        _rms(a @ w[f"{s}.q_a_proj.weight"].T, w[f"{s}.q_a_layernorm.weight"], 1e-6)
        @ w[f"{s}.q_b_proj.weight"].T
    )
    q = q.reshape(B, L, H, nope + rope).transpose(0, 2, 1, 3) * math.sqrt(D / qr)
    kv = a @ w[f"{s}.kv_a_proj_with_mqa.weight"].T
    latent = _rms(kv[..., :kvr], w[f"{s}.kv_a_layernorm.weight"], 1e-6) * math.sqrt(D / kvr)
    k_pe = _rope(kv[..., None, kvr:].transpose(0, 2, 1, 3), c["rope_theta"])  # [B, 1, L, rope]
    up = w[f"{s}.kv_b_proj.weight"].reshape(H, nope + vd, kvr)
    k_nope = latent[:, None] @ up[:, :nope].swapaxes(-1, -2)[None]  # [B, H, L, nope]
    v = latent[:, None] @ up[:, nope:].swapaxes(-1, -2)[None]
    q_pe = _rope(q[..., nope:], c["rope_theta"])
    scores = q[..., :nope] @ k_nope.swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2)
    o = _attend(scores / math.sqrt(nope + rope), v).transpose(0, 2, 1, 3).reshape(B, L, -1)
    x = x + o @ w[f"{s}.o_proj.weight"].T
    x = x + _mlp(w, f"{p}.transformer_layer.mlp", _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps))
    out = _rms(x, w["model.mtp.norm.weight"], eps)  # the head's own final norm: what chains
    return out @ w["lm_head.weight"].T, out


REFERENCES = {"ernie4_5_moe": _ernie_reference, "longcat_flash": _longcat_reference}


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
    want_logits, want_hidden = REFERENCES[family](raw, config, hidden[:, :-1], x[:, 1:])
    assert mx.abs(want_logits).max().item() > 1.0  # a real signal to compare
    assert mx.abs(got_logits - want_logits).max().item() < 1e-3
    assert mx.abs(got_hidden - want_hidden).max().item() < 1e-3


# -- identity and rollback -------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_single(loaded, family, k):
    _, model, _, head, _ = loaded[family]
    family_checks.greedy_identity_single(model, head, PROMPTS, N, k)


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


def test_ernie_quantized_kv_cache_identity(tiny_checkpoint):
    """ERNIE's plain KV layers run on mlx-lm's QuantizedKVCache (single sequence) exactly;
    LongCat's latent caches cannot be quantized (its receipt refuses kv_bits)."""
    from mlx_lm.models.cache import QuantizedKVCache

    from melix_fsm.receipt import ServingContext

    model, _, head, _ = load_with_heads(tiny_checkpoint("ernie4_5_moe", head_dim=32))
    kw = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    want = reference(model, PROMPTS[2], N, **kw)
    scripted = ScriptedHead(
        [PROMPTS[2] + reference(model, PROMPTS[2], N + 4, **kw)], VOCAB_SIZE, 64, wrong_every=3
    )
    for drafter in (head, scripted):
        for k in (1, 2):
            got, decoder = mtp(model, drafter, PROMPTS[2], N, k, **kw)
            assert got == want
            assert any(isinstance(c, QuantizedKVCache) for c in decoder.cache)
    receipt = resolve(tiny_checkpoint("longcat_flash"), context=ServingContext(quantized_kv=True))
    assert receipt.mode != "accepted" and receipt.refusal_reason is RefusalReason.unsupported_quantization


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_smoke_passes_with_the_sampled_distribution(loaded, family, capsys):
    """`melix-fsm verify` (smoke profile): identity single and batched, batch invariance,
    lifecycle probes, and sampled output at T = 1 following the model's distribution."""
    from melix_fsm.cli import main

    args = ["--profile", "smoke", "--draws", "100", "--seed", "1", "--json", "--quiet"]
    code = main(["verify", "--model", str(loaded[family][0]), *args])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"] == "pass" and report["bugs"] == []
    assert report["identity"] == "bit-exact" and report["receipt"]["family"] == family
    assert report["distribution"]["draws"] == 100
    assert report["parts"]["distribution (100 draws, T = 1)"]["result"] != "FAIL"
