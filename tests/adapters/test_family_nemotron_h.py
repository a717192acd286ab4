"""Nemotron-H (Nemotron-3): its MTP head on a tiny checkpoint in the HF layout.

- mlx-lm's own loader reads the main model (Mamba-2, MLP, attention and MoE layers), the
  project loader yields the same logits, the receipt admits the family with its own head
  module; the head's sub-layers follow the config's pattern ("*E": attention then MoE),
  also in the newer config spelling (``layers_block_type`` / ``mtp_layers_block_type``)
  with a latent MoE (``moe_latent_size``);
- the head's forward equals a reference forward written here from the published
  architecture (vLLM's nemotron_h_mtp) with plain mlx ops on the raw HF tensors (float32,
  tolerance 1e-3 on logits of scale ~10; the same reference with the concatenation
  swapped, or without the final norm, is off by more than 0.1);
- greedy MTP decoding equals mlx-lm's greedy output token for token, single sequence at
  k = 1..3 (one prompt under a repetition penalty) and batched (rows at k = 1, 2, 3, a
  row removed mid-run, a late joiner); rows accepting different lengths in the same
  cycles each select their own Mamba state (caches equal a single-sequence run's);
- after rejecting cycles the main cache (KV and every Mamba conv window and SSM state)
  equals a clean run fed only the confirmed tokens one at a time, with no replay forward;
- a converted directory gives the identical head; a 4-bit converted checkpoint keeps
  identity, and so does mlx-lm's 4-bit quantized KV cache on the attention layers;
- bfloat16 and float16 weights keep identity, single and batched (dense layers: mlx's CPU
  gather matmul, which MoE layers need, runs in float32 only);
- (slow) sampled decoding draws the target's joint of the first two tokens (G-test);
- a Mamba sub-layer in the head, or tensors that contradict the config's pattern, are
  typed errors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import family_checks
import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.convert import convert
from melix_mlx.loading.errors import HeadShapeMismatch, UnsupportedModel
from melix_mlx.loading.heads import nemotron_h
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.tools.tiny import make_tiny
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from scripted_head import ScriptedHead
from test_decode_rollback import CYCLES, PROMPT, clean_cache, max_diff, run_cycles

from melix_fsm.receipt import resolve

FAMILY = "nemotron_h"
N = 14
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]
LATE = [60, 61, 62, 63, 64]
HF_HEAD_KEYS = [
    "mtp.layers.0.enorm.weight",
    "mtp.layers.0.hnorm.weight",
    "mtp.layers.0.eh_proj.weight",
    "mtp.layers.0.norm.weight",
    "mtp.layers.0.mixer.q_proj.weight",
    "mtp.layers.1.mixer.gate.weight",
    "mtp.layers.1.mixer.gate.e_score_correction_bias",
    "mtp.layers.1.mixer.experts.3.up_proj.weight",
    "mtp.layers.1.mixer.shared_experts.down_proj.weight",
    "mtp.layers.1.final_layernorm.weight",
    "backbone.layers.0.mixer.conv1d.weight",
    "backbone.layers.0.mixer.A_log",
]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint) -> tuple:
    return (tiny_checkpoint(FAMILY), *load_with_heads(tiny_checkpoint(FAMILY)))


def test_hf_layout_loads_with_mlx_lm_and_is_admitted(loaded):
    _, model, _, head, _ = loaded
    family_checks.hf_layout_admitted(loaded, FAMILY, HF_HEAD_KEYS, PROMPTS[2])
    assert [layer.block_type for layer in head.layers] == ["*", "E"]
    assert [type(c) for c in head.make_cache()] == [KVCache]
    assert {type(c) for c in make_prompt_cache(model)} == {ArraysCache, KVCache}


# -- the reference forward -------------------------------------------------------------------
def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _relu2_mlp(w: dict, p: str, x: mx.array) -> mx.array:
    return mx.square(mx.maximum(x @ w[f"{p}.up_proj.weight"].T, 0.0)) @ w[f"{p}.down_proj.weight"].T


def _attention(w: dict, c: dict, p: str, a: mx.array) -> mx.array:
    """Grouped-query causal attention without positional encoding (Nemotron-H has none)."""
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    B, L, _ = a.shape

    def heads(name: str, n: int) -> mx.array:
        return (a @ w[f"{p}.{name}.weight"].T).reshape(B, L, n, hd).transpose(0, 2, 1, 3)

    q, k, v = heads("q_proj", H), heads("k_proj", KV), heads("v_proj", KV)
    k, v = mx.repeat(k, H // KV, axis=1), mx.repeat(v, H // KV, axis=1)
    causal = mx.tril(mx.ones((L, L), dtype=mx.bool_))
    probs = mx.softmax(mx.where(causal, (q @ k.swapaxes(-1, -2)) / math.sqrt(hd), -1e30), axis=-1)
    return (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, -1) @ w[f"{p}.o_proj.weight"].T


def _moe(w: dict, c: dict, p: str, a: mx.array) -> mx.array:
    """Sigmoid router (bias only for the choice), top-k renormalised and scaled, squared-ReLU
    experts (in a latent space when fc1/fc2_latent_proj exist), plus the shared expert."""
    scores = mx.sigmoid(a @ w[f"{p}.gate.weight"].T)
    choice = scores + w[f"{p}.gate.e_score_correction_bias"]
    top = mx.argsort(-choice, axis=-1)[..., : c["num_experts_per_tok"]]
    weights = mx.take_along_axis(scores, top, axis=-1)
    weights = weights / weights.sum(axis=-1, keepdims=True) * c["routed_scaling_factor"]
    latent = f"{p}.fc1_latent_proj.weight" in w
    z = a @ w[f"{p}.fc1_latent_proj.weight"].T if latent else a
    routed = mx.zeros_like(z)
    for slot in range(top.shape[-1]):
        for e in range(c["n_routed_experts"]):
            pick = (top[..., slot] == e)[..., None]
            routed = routed + mx.where(
                pick, weights[..., slot : slot + 1] * _relu2_mlp(w, f"{p}.experts.{e}", z), 0.0
            )
    if latent:
        routed = routed @ w[f"{p}.fc2_latent_proj.weight"].T
    return routed + _relu2_mlp(w, f"{p}.shared_experts", a)


def _reference(
    w: dict, c: dict, hidden: mx.array, tokens: mx.array, *, swap: bool = False, final: bool = True
):
    eps = c["layer_norm_epsilon"]
    e = _rms(w["backbone.embeddings.weight"][tokens], w["mtp.layers.0.enorm.weight"], eps)
    h = _rms(hidden, w["mtp.layers.0.hnorm.weight"], eps)
    x = mx.concatenate([h, e] if swap else [e, h], axis=-1) @ w["mtp.layers.0.eh_proj.weight"].T
    x = x + _attention(w, c, "mtp.layers.0.mixer", _rms(x, w["mtp.layers.0.norm.weight"], eps))
    x = x + _moe(w, c, "mtp.layers.1.mixer", _rms(x, w["mtp.layers.1.norm.weight"], eps))
    out = _rms(x, w["mtp.layers.1.final_layernorm.weight"], eps) if final else x
    return out @ w["lm_head.weight"].T, out  # the shared lm_head; the post-norm output chains


def _check_head_against_reference(path: Path, model, head) -> None:
    raw: dict[str, mx.array] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    config = json.loads((path / "config.json").read_text())
    x = mx.array([PROMPTS[2]])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))  # post-norm (norm_f)
    got_logits, got_hidden = head(hidden[:, :-1], x[:, 1:], head.make_cache())
    want_logits, want_hidden = _reference(raw, config, hidden[:, :-1], x[:, 1:])
    assert mx.abs(want_logits).max().item() > 1.0  # a real signal to compare
    assert mx.abs(got_logits - want_logits).max().item() < 1e-3
    assert mx.abs(got_hidden - want_hidden).max().item() < 1e-3
    for wrong in ({"swap": True}, {"final": False}):  # the comparison is sharp
        assert (
            mx.abs(got_logits - _reference(raw, config, hidden[:, :-1], x[:, 1:], **wrong)[0]).max().item()
            > 0.1
        )


def test_head_forward_matches_the_published_architecture(loaded):
    path, model, _, head, _ = loaded
    _check_head_against_reference(path, model, head)


def test_newer_config_spelling_and_latent_moe(tmp_path):
    """``layers_block_type`` / ``mtp_layers_block_type`` lists instead of the pattern
    strings and no ``num_hidden_layers``, and a latent MoE (Nemotron-3 Super): admitted,
    same head layout, reference forward, greedy identity."""
    path = make_tiny(FAMILY, tmp_path / "newer", moe_latent_size=32)
    config = json.loads((path / "config.json").read_text())
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    config["layers_block_type"] = [kinds[c] for c in config.pop("hybrid_override_pattern")]
    config["mtp_layers_block_type"] = [kinds[c] for c in config.pop("mtp_hybrid_override_pattern")]
    del config["num_hidden_layers"]  # transformers derives it from the block list
    (path / "config.json").write_text(json.dumps(config))
    receipt = resolve(path)
    assert receipt.mode == "accepted", receipt.message
    model, _, head, _ = load_with_heads(path)
    assert [layer.block_type for layer in head.layers] == ["*", "E"]
    assert "fc1_latent_proj" in head.layers[1].mixer
    _check_head_against_reference(path, model, head)
    assert mtp(model, head, PROMPTS[0], N, 2)[0] == reference(model, PROMPTS[0], N)


def test_head_layout_errors_are_typed(loaded):
    path = loaded[0]
    config = json.loads((path / "config.json").read_text())
    raw = {k: v for f in Path(path).glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    with pytest.raises(UnsupportedModel, match="Mamba"):
        nemotron_h.from_hf(raw, {**config, "mtp_hybrid_override_pattern": "M*"})
    with pytest.raises(HeadShapeMismatch, match="'\\*E'"):
        nemotron_h.from_hf(raw, {**config, "mtp_hybrid_override_pattern": "*-"})


# -- identity and rollback -------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_identity_single(loaded, k):
    _, model, _, head, _ = loaded
    for decoder in family_checks.greedy_identity_single(model, head, PROMPTS, N, k):
        assert decoder.stats["replay_forwards"] == 0


def test_greedy_identity_batched_with_removal_and_late_joiner(loaded):
    _, model, _, head, _ = loaded
    refs = [reference(model, p, N) for p in PROMPTS]
    hidden = main_parts(model).args.hidden_size
    # a head right on row 0, wrong every third position on row 1, random on the others:
    # rows accept different lengths in the same cycles and select different states
    scripted = ScriptedHead([PROMPTS[0] + refs[0], PROMPTS[1] + refs[1]], VOCAB_SIZE, hidden, wrong_every=3)
    for drafter in (head, scripted):
        stats = family_checks.batched_identity(model, drafter, PROMPTS, LATE, N)
        assert stats.get("replay_forwards", 0) == 0


def test_batched_rows_select_their_own_states(loaded):
    """Rows accepting different lengths in the same cycles (a right script, one wrong every
    third position, the random head's rejections): each row's extracted cache (KV, conv
    windows, SSM states) equals a single-sequence run over its context, prefilled as
    mlx-lm prefills and then fed one token at a time, bit for bit."""
    _, model, _, head, _ = loaded
    refs = [reference(model, p, 24) for p in PROMPTS]
    scripted = ScriptedHead([PROMPTS[0] + refs[0], PROMPTS[1] + refs[1]], VOCAB_SIZE, 64, wrong_every=3)
    gen = MTPBatchGenerator(model, scripted, num_draft_tokens=3, max_tokens=24)
    uids = gen.insert(PROMPTS)
    for _ in range(4):
        gen.next()
    extracted = gen.extract_cache(set(uids))
    rates = []
    for uid, prompt in zip(uids, PROMPTS, strict=True):
        cache, context = extracted[uid]
        clean = make_prompt_cache(model)
        model(mx.array([context[: len(prompt) - 1]]), cache=clean)
        for t in context[len(prompt) - 1 :]:
            model(mx.array([[t]]), cache=clean)
        assert max_diff(cache, clean) == 0.0, uid
        rates.append(next(r for r in gen.batch if r.uid == uid).counters.acceptance_rate)
    assert len(set(rates)) == 3  # three different acceptance lengths in one batch


def test_rollback_cache_equals_clean_run(loaded, monkeypatch):
    _, model, _, head, _ = loaded
    script = PROMPT + reference(model, PROMPT, 40)
    scripted = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    for name, drafter, k in (("partial", scripted, 3), ("random", head, 2)):
        decoder, kept, _ = run_cycles(model, drafter, k, monkeypatch)
        assert decoder.stats["rollbacks"] == CYCLES, name
        tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
        assert max_diff(decoder.cache, tokenwise) == 0.0, name
        assert decoder.stats["replay_forwards"] == 0


def test_converted_dir_gives_identical_head(loaded, tmp_path):
    path, model, _, head, info = loaded
    assert not info.norms_repaired_on_load  # plain RMSNorm weights: nothing to repair
    out = convert(path, tmp_path / "converted")
    assert json.loads((out / "config.json").read_text())["melix_mtp"]["family"] == FAMILY
    m2, _, h2, info2 = load_with_heads(out)
    assert info2.head_format == "melix"
    x = mx.array([PROMPTS[2]])
    outs = []
    for m, h in ((model, head), (m2, h2)):
        _, hidden = forward_with_hidden(m, x, make_prompt_cache(m))
        outs.append(h(hidden[:, :-1], x[:, 1:], h.make_cache()))
    for u, v in zip(outs[0], outs[1], strict=True):
        assert mx.abs(u - v).max().item() == 0.0


def test_4bit_identity(loaded, tmp_path):
    out = convert(loaded[0], tmp_path / "q4", quantize=True, q_group_size=32)
    model, _, head, info = load_with_heads(out)
    assert info.main_quantized and info.family == FAMILY
    hidden = main_parts(model).args.hidden_size
    rollbacks = 0
    for prompt in PROMPTS[::2]:
        want = reference(model, prompt, N)
        scripted = ScriptedHead([prompt + reference(model, prompt, N + 4)], VOCAB_SIZE, hidden, wrong_every=3)
        for k in (1, 2):
            assert mtp(model, head, prompt, N, k)[0] == want
            got, decoder = mtp(model, scripted, prompt, N, k)
            assert got == want and decoder.stats["accepted"] > 0
            rollbacks += decoder.stats["rollbacks"]
    assert rollbacks > 0  # the scripted head's wrong drafts were rolled back
    # the head quantized too: its sub-layers are read from the quantized tensors
    out = convert(loaded[0], tmp_path / "q4-head", quantize=True, q_group_size=32, quantize_head=True)
    model, _, head, info = load_with_heads(out)
    assert info.head_quantized and [layer.block_type for layer in head.layers] == ["*", "E"]
    assert mtp(model, head, PROMPTS[2], N, 2)[0] == reference(model, PROMPTS[2], N)


def test_quantized_kv_cache_identity(tiny_checkpoint):
    """mlx-lm's quantized KV cache on the attention layers, Mamba state captured beside it."""
    model, _, head, _ = load_with_heads(tiny_checkpoint(FAMILY, head_dim=32))
    kw = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
    want = reference(model, PROMPT, N, **kw)
    assert want != reference(model, PROMPT, N)  # the quantization is applied
    scripted = ScriptedHead([PROMPT + reference(model, PROMPT, N + 4, **kw)], VOCAB_SIZE, 64, wrong_every=3)
    for drafter in (head, scripted):
        got, decoder = mtp(model, drafter, PROMPT, N, 2, **kw)
        assert got == want and decoder.stats["rollbacks"] > 0


@pytest.mark.slow  # about 30 s: 1,000 sampled starts
def test_sampled_joint_of_first_two_tokens(tiny_checkpoint):
    """test_decode_sampling's G-test of the first two sampled tokens against the exact
    target joint, on a one-Mamba-one-attention-layer Nemotron-H (the verify of the first
    cycle runs the armed mixer; a rejection selects its captured state)."""
    from melix_mlx.runtime.sampling import make_sampler, normalize_logits, params_of, probabilities
    from test_decode_sampling import ALPHA, draw_pairs, g_test

    path = tiny_checkpoint(FAMILY, hybrid_override_pattern="M*", num_hidden_layers=2)
    model, tokenizer, _, _ = load_with_heads(path)
    sampler = make_sampler(temp=1.0, top_k=4)
    params = params_of(sampler)
    prompt = [72]

    def dist(tokens: list[int]) -> mx.array:
        return probabilities(normalize_logits(model(mx.array([tokens]))[0, -1]), params)

    p1, joint, scripts = dist(prompt), {}, []
    for t1 in (t for t in range(VOCAB_SIZE) if p1[t].item() > 0):
        p2 = dist(prompt + [t1])
        joint.update(
            {(t1, t2): p1[t1].item() * p2[t2].item() for t2 in range(VOCAB_SIZE) if p2[t2].item() > 0}
        )
        scripts.append(prompt + [t1, int(mx.argmax(p2).item())])
    head = ScriptedHead(scripts, VOCAB_SIZE, main_parts(model).args.hidden_size, confidence=2.0)
    counts, totals = draw_pairs((model, tokenizer, head, sampler, joint), 1000, seed=20261206)
    assert len(joint) == 16 and set(counts) <= set(joint)
    assert totals["accepted"] > 100 and totals["rejected"] > 100
    assert g_test(counts, joint) > ALPHA


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_identity(tiny_checkpoint, dtype):
    """Half-precision weights (the conv window in the model's dtype, the SSM state in
    float32, as mlx-lm keeps them), single and batched. Dense MLP layers here: mlx's CPU
    gather matmul, which MoE layers use, runs in float32 only (mlx-lm's own decode fails)."""
    path = tiny_checkpoint(
        FAMILY, dtype=dtype, hybrid_override_pattern="M-M*-M", mtp_hybrid_override_pattern="*-"
    )
    model, _, head, _ = load_with_heads(path)
    assert [layer.block_type for layer in head.layers] == ["*", "-"]
    refs = [reference(model, p, N) for p in PROMPTS]
    for k in (1, 3):
        assert mtp(model, head, PROMPTS[2], N, k)[0] == refs[2]
    gen = MTPBatchGenerator(model, head, max_tokens=N)
    uids = gen.insert(PROMPTS, num_draft_tokens=[1, 2, 3])
    out: dict[int, list[int]] = {u: [] for u in uids}
    for _ in range(200):
        if not (gen.batch.uids or gen._queue):
            break
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    assert [out[u] for u in uids] == refs
