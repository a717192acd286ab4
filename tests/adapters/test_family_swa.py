"""The sliding-window families: MiMo-V2-Flash, Step-3.5 and EXAONE MoE, on tiny checkpoints
in their HF layout (window 8; melix_mlx.tools.tiny_swa).

For each family:
- mlx-lm's own loader reads the main model (a KVCache + RotatingKVCache hybrid), the
  project loader yields the same logits, the receipt admits the family with its own head
  module, single and batched;
- the head's forward equals a reference forward written here from the published
  architecture with plain mlx ops on the raw HF tensors (float32, tolerance 1e-3 on logits
  of scale ~10), over a prompt longer than the window so a head's own window is applied:
  MiMo-V2-Flash's sliding attention with sink biases, partial RoPE and value scale;
  Step-3.5's zero-centred norms and the PRE-norm main hidden it reads (the reference is fed
  the main model's last layer output before its final norm, the head the post-norm
  hidden the engine gives every head); EXAONE's full-attention NoPE head layer;
- greedy MTP decoding equals mlx-lm's greedy output token for token, single sequence at
  k = 1..3 (one prompt under a repetition penalty) and batched (rows at k = 1, 2, 3, a
  row removed mid-run, a late joiner), every prompt and output crossing the window;
- after rejecting cycles the main cache equals a clean run fed only the confirmed tokens,
  to float32 rounding (1e-5 single, 1e-4 batched: a window's masked attention sums over a
  buffer of another length than mlx-lm's, batched matmuls in another order): single
  sequence (windows compared over the positions a window holds) and batched (each row
  extracted), no replay;
- a finished row hands back its windows in mlx-lm's form, holding exactly its
  `all_tokens`, and a continuation inserted on them decodes as mlx-lm does;
- a 4-bit converted checkpoint keeps identity; a quantized KV cache is refused for the
  window (typed, `unsupported_quantization`), not for the family;
- deepseek_v41 runs one sequence at a time (its cache kind refused batched, typed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import family_checks
import mlx.core as mx
import mlx.nn as nn
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime import rollback
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.runtime.window_kv import WindowedKVCache
from melix_mlx.tools.tiny_swa import FAMILIES, WINDOW
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from scripted_head import ScriptedHead
from test_decode_rollback import CYCLES, PROMPT, clean_cache, run_cycles

from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import ServingContext, resolve

N = 20
PROMPTS = [
    [5, 17, 33, 2, 9, 41, 7, 3, 11, 12, 13, 14],
    [100, 3, 8],
    [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
]
LATE = [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
LONG = [(7 * i) % 200 + 1 for i in range(20)]  # longer than the window
TOLERANCE = 1e-4  # batched rows against a lone run: float32 rounding of batched matmuls

HF_HEAD_KEYS = {
    "mimo_v2_flash": [
        "model.mtp.layers.0.enorm.weight",
        "model.mtp.layers.0.eh_proj.weight",
        "model.mtp.layers.0.self_attn.attention_sink_bias",
        "model.mtp.layers.0.pre_mlp_layernorm.weight",
        "model.mtp.layers.0.final_layernorm.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
    ],
    "step3p5": [
        "model.layers.3.enorm.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.output.weight",
        "model.layers.3.self_attn.g_proj.weight",
        "model.layers.1.moe.gate_proj.weight",
        "model.layers.1.share_expert.up_proj.weight",
    ],
    "exaone_moe": [
        "mtp.fc.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.mlp.gate_proj.weight",
        "mtp.norm.weight",
        "model.layers.1.mlp.e_score_correction_bias",
    ],
}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint) -> dict[str, tuple]:
    return {f: (tiny_checkpoint(f), *load_with_heads(tiny_checkpoint(f))) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_layout_loads_with_mlx_lm_and_is_admitted(loaded, family):
    path, model = loaded[family][:2]
    contexts = (ServingContext(), ServingContext(batched=True))
    receipts = family_checks.hf_layout_admitted(loaded[family], family, HF_HEAD_KEYS[family], LONG, contexts)
    assert {type(c) for c in make_prompt_cache(model)} == {KVCache, RotatingKVCache}
    for receipt in receipts:
        assert {(p.kind, p.strategy) for p in receipt.caches} == {
            ("kv", "trim"),
            ("rotating", "window_spare"),
        }
    quantized = resolve(path, context=ServingContext(quantized_kv=True, kv_group_size=8))
    assert (
        quantized.refusal_reason is RefusalReason.unsupported_quantization and "rotating" in quantized.message
    )


# -- the reference forwards ------------------------------------------------------------------
def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: mx.array, dims: int, base: float) -> mx.array:
    """Rotate-half RoPE on the first `dims` features of x [B, H, L, d], from position 0."""
    half = dims // 2
    inv = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    ang = mx.arange(x.shape[-2], dtype=mx.float32)[:, None] * inv[None]
    cos, sin = mx.cos(ang), mx.sin(ang)
    a, b, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)


def _attend(
    q: mx.array, k: mx.array, v: mx.array, window: int | None, sinks: mx.array | None = None
) -> mx.array:
    """Softmax attention [B, H, L, dv]: causal, over the last `window` positions if given,
    with a per-head sink logit in the denominator if given."""
    length = q.shape[-2]
    k, v = mx.repeat(k, q.shape[1] // k.shape[1], axis=1), mx.repeat(v, q.shape[1] // v.shape[1], axis=1)
    scores = (q @ k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
    i, j = mx.arange(length)[:, None], mx.arange(length)[None]
    seen = (j <= i) & ((i - j < window) if window is not None else True)
    scores = mx.where(seen, scores, -1e30)
    if sinks is not None:
        sink = mx.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
        return mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1] @ v
    return mx.softmax(scores, axis=-1) @ v


def _heads(w: dict, p: str, x: mx.array, n: int, d: int) -> mx.array:
    B, L, _ = x.shape
    return (x @ w[f"{p}.weight"].T).reshape(B, L, n, d).transpose(0, 2, 1, 3)


def _mlp(w: dict, p: str, x: mx.array) -> mx.array:
    g = x @ w[f"{p}.gate_proj.weight"].T
    return (g * mx.sigmoid(g) * (x @ w[f"{p}.up_proj.weight"].T)) @ w[f"{p}.down_proj.weight"].T


def _merge(o: mx.array) -> mx.array:
    B, _, L, _ = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _mimo_v2_flash_reference(w: dict, c: dict, hidden: mx.array, tokens: mx.array, _: Any) -> tuple:
    eps, p = c["layernorm_epsilon"], "model.mtp.layers.0"
    H, KV, qk, vd = (
        c[f"swa_{k}"] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim")
    )
    e = _rms(w["model.embed_tokens.weight"][tokens], w[f"{p}.enorm.weight"], eps)
    h = _rms(hidden, w[f"{p}.hnorm.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ w[f"{p}.eh_proj.weight"].T
    a = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
    rot = int(c["partial_rotary_factor"] * qk)
    q = _rope(_heads(w, f"{p}.self_attn.q_proj", a, H, qk), rot, c["swa_rope_theta"])
    k = _rope(_heads(w, f"{p}.self_attn.k_proj", a, KV, qk), rot, c["swa_rope_theta"])
    v = _heads(w, f"{p}.self_attn.v_proj", a, KV, vd) * c["attention_value_scale"]
    o = _attend(q, k, v, c["sliding_window_size"], w[f"{p}.self_attn.attention_sink_bias"])
    x = x + _merge(o) @ w[f"{p}.self_attn.o_proj.weight"].T
    x = x + _mlp(w, f"{p}.mlp", _rms(x, w[f"{p}.pre_mlp_layernorm.weight"], eps))
    out = _rms(x, w[f"{p}.final_layernorm.weight"], eps)  # the lm_head input and what chains
    return out @ w["lm_head.weight"].T, out


def _step3p5_reference(w: dict, c: dict, hidden: mx.array, tokens: mx.array, pre: mx.array) -> tuple:
    """Fed the PRE-norm hidden `pre`; zero-centred norms compute with 1 + w."""
    eps, i = c["rms_norm_eps"], c["num_hidden_layers"]
    p, other = f"model.layers.{i}", c["attention_other_setting"]
    H, KV, hd = other["num_attention_heads"], other["num_attention_groups"], c["head_dim"]
    assert c["layer_types"][i] == "sliding_attention" and c["partial_rotary_factors"][i] == 1.0

    def norm(x: mx.array, name: str) -> mx.array:
        return _rms(x, 1.0 + w[f"{p}.{name}.weight"], eps)

    e = norm(w["model.embed_tokens.weight"][tokens], "enorm")
    x = mx.concatenate([e, norm(pre, "hnorm")], axis=-1) @ w[f"{p}.eh_proj.weight"].T
    a = norm(x, "input_layernorm")
    q = _heads(w, f"{p}.self_attn.q_proj", a, H, hd)
    k = _heads(w, f"{p}.self_attn.k_proj", a, KV, hd)
    q = _rope(_rms(q, 1.0 + w[f"{p}.self_attn.q_norm.weight"], eps), hd, c["rope_theta"][i])
    k = _rope(_rms(k, 1.0 + w[f"{p}.self_attn.k_norm.weight"], eps), hd, c["rope_theta"][i])
    o = _attend(q, k, _heads(w, f"{p}.self_attn.v_proj", a, KV, hd), c["sliding_window"])
    gate = mx.sigmoid(a @ w[f"{p}.self_attn.g_proj.weight"].T).transpose(0, 2, 1)[..., None]
    x = x + _merge(o * gate) @ w[f"{p}.self_attn.o_proj.weight"].T
    x = x + _mlp(w, f"{p}.mlp", norm(x, "post_attention_layernorm"))
    logits = norm(x, "shared_head.norm") @ w[f"{p}.shared_head.output.weight"].T
    return logits, x  # the pre-norm layer output chains


def _exaone_moe_reference(w: dict, c: dict, hidden: mx.array, tokens: mx.array, _: Any) -> tuple:
    eps, p = c["rms_norm_eps"], "mtp.layers.0"
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    assert c["mtp_layer_types"] == ["full_attention"]  # full attention, no rotary embedding
    e = _rms(w["model.embed_tokens.weight"][tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ w["mtp.fc.weight"].T
    a = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
    q = _rms(_heads(w, f"{p}.self_attn.q_proj", a, H, hd), w[f"{p}.self_attn.q_norm.weight"], eps)
    k = _rms(_heads(w, f"{p}.self_attn.k_proj", a, KV, hd), w[f"{p}.self_attn.k_norm.weight"], eps)
    o = _attend(q, k, _heads(w, f"{p}.self_attn.v_proj", a, KV, hd), None)
    x = x + _merge(o) @ w[f"{p}.self_attn.o_proj.weight"].T
    x = x + _mlp(w, f"{p}.mlp", _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps))
    out = _rms(x, w["mtp.norm.weight"], eps)  # the lm_head input and what chains
    return out @ w["lm_head.weight"].T, out


REFERENCES = {
    "mimo_v2_flash": _mimo_v2_flash_reference,
    "step3p5": _step3p5_reference,
    "exaone_moe": _exaone_moe_reference,
}


def _pre_norm_hidden(model: nn.Module, x: mx.array) -> mx.array:
    """The main model's last layer output, before its final norm."""
    inner = main_parts(model).inner
    final = inner.norm
    inner.norm = nn.Identity()
    try:
        return inner(x, make_prompt_cache(model))
    finally:
        inner.norm = final


@pytest.mark.parametrize("family", FAMILIES)
def test_head_forward_matches_the_published_architecture(loaded, family):
    path, model, _, head, _ = loaded[family]
    raw: dict[str, mx.array] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        raw.update(mx.load(str(f)))
    config = json.loads((path / "config.json").read_text())
    x = mx.array([LONG])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    pre = _pre_norm_hidden(model, x)
    cache = head.make_cache()
    got_logits, got_hidden = head(hidden[:, :-1], x[:, 1:], cache)
    want_logits, want_hidden = REFERENCES[family](raw, config, hidden[:, :-1], x[:, 1:], pre[:, :-1])
    if family == "step3p5":  # the head carries its layer output in the main model's post-norm form
        want_hidden = _rms(want_hidden, main_parts(model).inner.norm.weight, config["rms_norm_eps"])
    assert mx.abs(want_logits).max().item() > 1.0  # a real signal to compare
    assert mx.abs(got_logits - want_logits).max().item() < 1e-3
    assert mx.abs(got_hidden - want_hidden).max().item() < 1e-3
    windowed = family != "exaone_moe"
    assert isinstance(cache[0], WindowedKVCache) == windowed and len(LONG) > WINDOW


# -- identity --------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_single(loaded, family, k):
    _, model, _, head, _ = loaded[family]
    for decoder in family_checks.greedy_identity_single(model, head, PROMPTS, N, k):
        assert any(isinstance(c, WindowedKVCache) for c in decoder.cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_batched_with_removal_and_late_joiner(loaded, family):
    _, model, _, head, _ = loaded[family]
    family_checks.batched_identity(model, head, PROMPTS, LATE, N)


# -- rollback --------------------------------------------------------------------------------
def _window_diff(mine: list[Any], clean: list[Any]) -> float:
    """Largest difference over what each layer holds: a window's last positions (at least
    the W - 1 the next query reaches), a KV layer's whole context."""
    worst = 0.0
    for x, y in zip(rollback.leaves(mine), rollback.leaves(clean), strict=True):
        assert x.offset == y.offset
        if isinstance(y, RotatingKVCache):
            n = min(x.keys.shape[2], y.size())
            assert n >= WINDOW - 1
            theirs = [y._temporal_order(a)[..., -n:, :] for a in (y.keys, y.values)]
            ours = [a[..., -n:, :] for a in (x.keys, x.values)]
        else:
            theirs = [a[..., : y.offset, :] for a in (y.keys, y.values)]
            ours = [a[..., : x.offset, :] for a in (x.keys, x.values)]
        for u, v in zip(ours, theirs):
            assert u.shape == v.shape
            worst = max(worst, mx.abs(u - v).max().item())
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_cache_equals_clean_run(loaded, family, monkeypatch):
    _, model, _, head, _ = loaded[family]
    script = PROMPT + reference(model, PROMPT, 40)
    scripted = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    for name, drafter, k in (("partial", scripted, 3), ("random", head, 2)):
        decoder, kept, _ = run_cycles(model, drafter, k, monkeypatch)
        assert decoder.stats["rollbacks"] == CYCLES, name
        assert decoder.cache[0].offset > WINDOW  # the windows wrapped
        tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
        # a window attends over a masked buffer of another length than mlx-lm's rotating
        # one: the same positions, float32 sums in another order (a kept rejected entry
        # or a lost one moves values by O(1))
        assert _window_diff(decoder.cache, tokenwise) < 1e-5, name
        assert decoder.stats["replay_forwards"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_after_rejections_equal_a_clean_run(loaded, family):
    _, model, _, _, _ = loaded[family]
    hidden = main_parts(model).args.hidden_size
    scripts = [p + reference(model, p, 3 * N) for p in PROMPTS]
    gen = MTPBatchGenerator(model, ScriptedHead(scripts, VOCAB_SIZE, hidden, wrong_every=3), max_tokens=3 * N)
    gen.insert(PROMPTS, num_draft_tokens=[3, 2, 3])
    for _ in range(10):
        gen.next()
    assert gen.speculative_stats()["rollbacks"] > 0
    for i, row in enumerate(gen.batch.rows):
        context = row.payload.context  # every token the row's caches hold, in order
        assert len(context) > 2 * WINDOW
        clean = make_prompt_cache(model)
        for t in context:
            model(mx.array([[t]]), cache=clean)
        for mine, theirs in zip([c.extract(i) for c in gen.engine.cache], clean, strict=True):
            assert type(mine) is type(theirs) and mine.offset == theirs.offset == len(context)
            a, b = mine.state[:2], theirs.state[:2]
            if isinstance(theirs, RotatingKVCache):
                a, b = [mine._temporal_order(u) for u in a], [theirs._temporal_order(u) for u in b]
            else:
                b = [u[..., : theirs.offset, :] for u in b]
            for u, v in zip(a, b, strict=True):
                assert u.shape == v.shape and mx.abs(u - v).max().item() < TOLERANCE
    gen.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_identity(loaded, family, tmp_path):
    family_checks.four_bit_identity(loaded[family][0], family, tmp_path, PROMPTS[::2], N)


def test_deepseek_v41_runs_one_sequence_and_is_refused_batched() -> None:
    """DeepSeek-V4.1 runs its DSpark block drafter (tests/adapters/test_family_deepseek_v41.py)
    on a LayerCache that rolls back exactly one sequence at a time; batched, it is refused
    typed."""
    from mlx_lm.models.deepseek_v41 import LayerCache

    from melix_fsm.registry import Support, registry

    family = registry().families["deepseek_v41"]
    assert family.support is Support.mtp and not family.batch_reshape
    assert "block drafter" in family.doc and family.cache_kinds == ("layer_cache",)
    cache = [LayerCache(WINDOW), LayerCache(WINDOW)]
    assert rollback.kind_of(cache[0]) == "layer_cache"
    assert rollback.refusal(cache) is None
    text = rollback.refusal(cache, batched=True)
    assert text is not None and text.startswith(RefusalReason.unsupported_cache_sharing.value)
    assert "layer_cache" in text and "LayerCache" in text


@pytest.mark.parametrize("family", FAMILIES)
def test_finished_rows_hand_back_their_windows(loaded, family):
    """A row that ends hands back mlx-lm's form of its caches (a window as RotatingKVCache,
    its last W positions), holding exactly `all_tokens`: the prompt and every token but the
    last; inserted again with a continuation, it decodes as mlx-lm does over the whole text."""
    _, model, _, head, _ = loaded[family]
    hidden = main_parts(model).args.hidden_size
    scripts = [p + reference(model, p, N + 4) for p in PROMPTS]
    gen = MTPBatchGenerator(model, ScriptedHead(scripts, VOCAB_SIZE, hidden), num_draft_tokens=2)
    uids = gen.insert(PROMPTS, max_tokens=[N, N - 3, N - 1])
    finished, last = {}, {}
    while gen.batch.uids or gen._queue:
        for r in gen.next()[1]:
            last[r.uid] = r.token
            if r.finish_reason is not None:
                finished[r.uid] = r
    gen.close()
    for uid, prompt in zip(uids, PROMPTS, strict=True):
        done = finished[uid]
        assert done.all_tokens[: len(prompt)] == prompt and len(done.all_tokens) > WINDOW
        clean = make_prompt_cache(model)
        for t in done.all_tokens:
            model(mx.array([[t]]), cache=clean)
        assert [type(c) for c in done.prompt_cache] == [type(c) for c in clean]
        assert _window_diff(done.prompt_cache, clean) < TOLERANCE
    done = finished[uids[0]]
    more = [last[uids[0]], 60, 61, 62]  # the last emitted token, then the caller's new text
    again = MTPBatchGenerator(model, head, num_draft_tokens=3)
    (uid,) = again.insert([more], max_tokens=[12], caches=[done.prompt_cache], all_tokens=[done.all_tokens])
    got: list[int] = []
    while again.batch.uids or again._queue:
        got += [r.token for r in again.next()[1] if r.uid == uid]
    again.close()
    assert got == reference(model, done.all_tokens + more, 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_sequence_runs_ahead_on_window_batch_form(loaded, family):
    """With run-ahead (the GPU default) one sequence decodes on one-row batch caches, its
    windows included (rollback in the graph), and hands them back in mlx-lm's form holding
    the prompt and every token but the last."""
    _, model, _, head, _ = loaded[family]
    hidden = main_parts(model).args.hidden_size
    rollbacks = 0
    for k in (2, 3):
        for prompt in (PROMPTS[0], LATE):
            want = reference(model, prompt, N)
            scripted = ScriptedHead(
                [prompt + reference(model, prompt, N + 4)], VOCAB_SIZE, hidden, wrong_every=3
            )
            for drafter in (head, scripted):
                cache = make_prompt_cache(model)
                got, decoder = mtp(model, drafter, prompt, N, k, run_ahead=True, prompt_cache=cache)
                assert got == want, (k, prompt)
                assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0
                assert {type(c) for c in cache} == {KVCache, RotatingKVCache}  # handed back
                clean = make_prompt_cache(model)
                for t in prompt + got[:-1]:
                    model(mx.array([[t]]), cache=clean)
                assert _window_diff(cache, clean) < 1e-5
                rollbacks += decoder.stats["rollbacks"]
    assert rollbacks > 0
