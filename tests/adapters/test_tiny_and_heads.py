"""Tiny checkpoints, main hidden states, MTP head loading/conversion and typed errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from melix_mlx.loading import load_with_heads, safetensors_keys
from melix_mlx.loading.convert import convert
from melix_mlx.loading.errors import (
    HeadLoadError,
    HeadShapeMismatch,
    MissingHeadWeights,
    UnsupportedModel,
)
from melix_mlx.loading.heads import HEAD_CLASSES
from melix_mlx.runtime.hidden import forward_with_hidden
from melix_mlx.tools.tiny import FAMILIES
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

PROMPT = "Hello world, this is a test."

# One upstream head key per family that must exist under its HF name.
HF_HEAD_KEYS = {
    "qwen3_5": [
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
    ],
    "deepseek_v3": [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.head.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
    ],
    "mimo": [
        "model.mtp_layers.0.input_proj.weight",
        "model.mtp_layers.0.token_layernorm.weight",
        "model.mtp_layers.0.self_attn.q_proj.bias",
    ],
}


def _all_keys(path: Path) -> set[str]:
    return {k for f in path.glob("*.safetensors") for k in safetensors_keys(f)}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _head_outputs(model, tok, head):
    x = mx.array([tok.encode(PROMPT)])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    return head(hidden[:, :-1], x[:, 1:], head.make_cache())


def _rewrite(path: Path, edit) -> None:
    """Apply ``edit(dict)`` to every safetensors file of ``path`` in place."""
    for f in path.glob("*.safetensors"):
        tensors = dict(mx.load(str(f)))
        mx.eval(tensors)  # mx.load is lazy: read everything before overwriting the file
        edit(tensors)
        if tensors:
            mx.save_safetensors(str(f), tensors)
        else:
            f.unlink()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_has_hf_layout_and_loads_with_mlx_lm(tiny_dirs, family):
    path = tiny_dirs[family]
    config = json.loads((path / "config.json").read_text())
    if family == "qwen3_5":
        assert config["text_config"]["mtp_num_hidden_layers"] == 1
    else:
        assert config["num_nextn_predict_layers"] == 1
    assert set(HF_HEAD_KEYS[family]) <= _all_keys(path)
    model, tok = mlx_lm.load(str(path))
    kinds = {type(c) for c in make_prompt_cache(model)}
    assert kinds == ({ArraysCache, KVCache} if family == "qwen3_5" else {KVCache})
    assert tok.decode(tok.encode(PROMPT)) == PROMPT


def test_qwen3_5_norms_are_stored_unrepaired(tiny_dirs):
    tensors = mx.load(str(tiny_dirs["qwen3_5"] / "model.safetensors"))
    # (1+w) convention: stored w sits near 0, not near 1
    assert abs(tensors["mtp.norm.weight"].mean().item()) < 0.2
    assert tensors["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[1] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_with_hidden_is_bitwise_equal_to_model(tiny_dirs, family):
    model, tok = mlx_lm.load(str(tiny_dirs[family]))
    x = mx.array([tok.encode(PROMPT)])
    ca, cb = make_prompt_cache(model), make_prompt_cache(model)
    for chunk in (x, x[:, :1], x[:, 1:3]):
        ref = model(chunk, cache=ca)
        logits, hidden = forward_with_hidden(model, chunk, cb)
        assert mx.array_equal(ref, logits).item()
        assert hidden.shape[:2] == chunk.shape and hidden.ndim == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_varied(tiny_dirs, family):
    model, tok = mlx_lm.load(str(tiny_dirs[family]))
    cache = make_prompt_cache(model)
    y = model(mx.array([tok.encode(PROMPT)]), cache=cache)[:, -1].argmax(-1)
    out = []
    for _ in range(24):
        out.append(y.item())
        y = model(y[:, None], cache=cache)[:, -1].argmax(-1)
    assert len(set(out)) >= 8, out


@pytest.mark.parametrize("family", FAMILIES)
def test_head_forward_shapes_cache_and_chaining(loaded_heads, family):
    model, tok, head, info = loaded_heads[family]
    assert isinstance(head, HEAD_CLASSES[family]) and info.family == family
    assert info.chain_post_norm == HEAD_CLASSES[family].CHAIN_POST_NORM
    assert info.concat_order == ("hidden_first" if family == "mimo" else "embedding_first")
    x = mx.array([tok.encode(PROMPT)])
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    cache = head.make_cache()
    logits, h = head(hidden[:, :-1], x[:, 1:], cache)
    L = x.shape[1] - 1
    assert logits.shape == (
        1,
        L,
        model.args.vocab_size if family != "qwen3_5" else model.language_model.args.vocab_size,
    )
    assert h.shape == (1, L, hidden.shape[-1])
    assert mx.isfinite(logits).all().item()
    assert cache[0].offset == L
    # depth 2: chain on the head's own hidden and its own draft
    logits2, _ = head(h[:, -1:], logits[:, -1:].argmax(-1), cache)
    assert logits2.shape[1] == 1 and cache[0].offset == L + 1
    cache[0].trim(1)
    assert cache[0].offset == L
    # head parameters exclude the shared main embedding
    names = {k for k, _ in tree_flatten(head.parameters())}
    assert not any("embed_tokens" in k for k in names)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_dir_gives_identical_head(tiny_dirs, converted_dirs, loaded_heads, family):
    model, tok, head, info = loaded_heads[family]
    assert info.head_format == "hf"
    assert info.norms_repaired_on_load == (family == "qwen3_5")
    m2, t2, h2, info2 = load_with_heads(converted_dirs[family])
    assert info2.head_format == "melix" and not info2.norms_repaired_on_load
    config = json.loads((converted_dirs[family] / "config.json").read_text())
    assert config["melix_mtp"]["norms_repaired"] is True
    a, b = _head_outputs(model, tok, head), _head_outputs(m2, t2, h2)
    for u, v in zip(a, b, strict=True):
        assert mx.abs(u - v).max().item() == 0.0
    mlx_lm.load(str(converted_dirs[family]))  # still a plain mlx-lm checkpoint


def test_qwen3_5_norm_repair_applied_exactly_once(tiny_dirs, converted_dirs, loaded_heads):
    raw = mx.load(str(tiny_dirs["qwen3_5"] / "model.safetensors"))
    head = loaded_heads["qwen3_5"][2]
    *_, head_converted, _ = load_with_heads(converted_dirs["qwen3_5"])
    for name, h in [("hf", head), ("converted", head_converted)]:
        for raw_key, param in [
            ("mtp.norm.weight", h.norm.weight),
            ("mtp.pre_fc_norm_hidden.weight", h.pre_fc_norm_hidden.weight),
            ("mtp.layers.0.self_attn.q_norm.weight", h.layers[0].self_attn.q_norm.weight),
        ]:
            assert mx.array_equal(param, raw[raw_key] + 1.0).item(), (name, raw_key)


def test_sidecar_head_is_loaded(tiny_checkpoint, loaded_heads):
    path = tiny_checkpoint("qwen3_5", head_in_sidecar=True)
    assert "mtp.fc.weight" in safetensors_keys(path / "mtp.safetensors")
    assert "mtp.fc.weight" not in safetensors_keys(path / "model.safetensors")
    model, tok, head, info = load_with_heads(path)
    assert info.sidecar and info.source_files == ("mtp.safetensors",)
    ref = _head_outputs(*loaded_heads["qwen3_5"][:3])  # same seed, head in model file
    got = _head_outputs(model, tok, head)
    assert mx.array_equal(ref[0], got[0]).item()


def test_deepseek_in_file_head_needs_our_loader(tiny_checkpoint):
    # mlx-lm's deepseek_v3 sanitize drops only model.layers.61: a 3-layer model with the
    # head inside model.safetensors fails its strict load; ours filters the head first.
    path = tiny_checkpoint("deepseek_v3", head_in_sidecar=False)
    with pytest.raises(ValueError):
        mlx_lm.load(str(path))
    model, tok, head, info = load_with_heads(path)
    assert not info.sidecar and info.own_lm_head
    assert mx.isfinite(_head_outputs(model, tok, head)[0]).all().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_head_weights_is_typed(tiny_dirs, tmp_path, family):
    path = _copy(tiny_dirs[family], tmp_path / "nohead")

    def drop_head(t):
        for k in [k for k in t if k in _head_keys(family, t)]:
            del t[k]

    _rewrite(path, drop_head)
    mlx_lm.load(str(path))  # the main model alone is fine
    with pytest.raises(MissingHeadWeights) as err:
        load_with_heads(path)
    assert err.value.reason == "missing_head_weights"


def _head_keys(family: str, tensors: dict) -> set[str]:
    from melix_mlx.loading.heads import FAMILY_MODULES

    cfg = {"num_hidden_layers": 3}
    return {k for k in tensors if FAMILY_MODULES[family].is_head_key(k, cfg)}


def test_mlx_lm_conversion_without_head_is_refused(tiny_dirs, tmp_path):
    from mlx_lm.convert import convert as mlx_convert

    out = tmp_path / "mlx-community-like"
    mlx_convert(str(tiny_dirs["mimo"]), str(out))
    with pytest.raises(MissingHeadWeights):
        load_with_heads(out)


def test_partially_missing_head_is_typed(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["mimo"], tmp_path / "partial")
    _rewrite(path, lambda t: t.pop("model.mtp_layers.0.input_proj.weight"))
    with pytest.raises(MissingHeadWeights) as err:
        load_with_heads(path)
    assert "input_proj.weight" in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_corrupted_head_tensor_shape_is_typed(tiny_dirs, tmp_path, family):
    path = _copy(tiny_dirs[family], tmp_path / "corrupt")
    key = HF_HEAD_KEYS[family][0]

    def corrupt(t):
        if key in t:
            t[key] = t[key][:, :-1]

    _rewrite(path, corrupt)
    with pytest.raises(HeadShapeMismatch) as err:
        load_with_heads(path)
    assert err.value.reason == "head_shape_mismatch"


@pytest.mark.parametrize("family", FAMILIES)
def test_head_for_other_hidden_size_is_typed(tiny_dirs, tiny_checkpoint, tmp_path, family):
    other = tiny_checkpoint(family, head_in_sidecar=True, hidden_size=32, seed=1)
    path = _copy(tiny_dirs[family], tmp_path / "wronghead")
    _rewrite(path, lambda t: [t.pop(k) for k in _head_keys(family, t)])
    shutil.copy(other / "mtp.safetensors", path / "mtp.safetensors")
    with pytest.raises(HeadShapeMismatch):
        load_with_heads(path)


def test_unsupported_models_are_typed(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["mimo"], tmp_path / "nohead-config")
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        load_with_heads(path)
    assert err.value.reason == "unsupported_model"
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadLoadError) as err:
        load_with_heads(path)
    assert err.value.reason == "unsupported_model"


def test_quantized_convert_keeps_head_unquantized_by_default(tiny_dirs, tmp_path):
    import mlx.nn as nn

    out = convert(tiny_dirs["mimo"], tmp_path / "q", quantize=True, q_group_size=32)
    model, tok, head, info = load_with_heads(out)
    assert info.main_quantized and not info.head_quantized
    assert isinstance(head.input_proj, nn.Linear)
    assert mx.isfinite(_head_outputs(model, tok, head)[0]).all().item()
    out2 = convert(tiny_dirs["mimo"], tmp_path / "qh", quantize=True, q_group_size=32, quantize_head=True)
    model, tok, head, info = load_with_heads(out2)
    assert info.head_quantized and isinstance(head.input_proj, nn.QuantizedLinear)
    assert mx.isfinite(_head_outputs(model, tok, head)[0]).all().item()
    # quantize_head at load time on a float-stored head
    *_, head3, info3 = load_with_heads(out, quantize_head=True, q_group_size=32)
    assert info3.head_quantized and isinstance(head3.input_proj, nn.QuantizedLinear)


@pytest.mark.parametrize("family", FAMILIES)
def test_head_prime_all_at_once_equals_step_by_step(loaded_heads, family):
    # What the engine relies on: priming the head cache over many pairs in one call gives
    # the same per-slot logits as feeding the pairs one by one (mask and RoPE offsets).
    model, tok, head, _ = loaded_heads[family]
    x = mx.array([tok.encode(PROMPT)] * 2)  # batch of 2 exercises B > 1
    _, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
    full, _ = head(hidden[:, :-1], x[:, 1:], head.make_cache())
    cache = head.make_cache()
    steps = [head(hidden[:, i : i + 1], x[:, i + 1 : i + 2], cache)[0] for i in range(8)]
    assert mx.allclose(full[:, :8], mx.concatenate(steps, axis=1), atol=1e-4).item()


def test_deepseek_fp8_head_tensor_is_dequantized(tiny_dirs, tmp_path):
    # Released DeepSeek-V3 stores the head layer in fp8 with 128x128 block inverse scales;
    # mlx-lm's sanitize dequantizes it before dropping it, so the head loader must too.
    path = _copy(tiny_dirs["deepseek_v3"], tmp_path / "fp8")
    key = "model.layers.3.eh_proj.weight"
    original = mx.load(str(path / "mtp.safetensors"))[key]
    mx.eval(original)
    scale = 0.01

    def to_fp8(t):
        if key not in t:
            return
        t[key] = mx.to_fp8(t[key] / scale)
        t[key + "_scale_inv"] = mx.full((1, 1), scale)

    _rewrite(path, to_fp8)
    *_, head, _ = load_with_heads(path)
    got = head.eh_proj.weight.astype(mx.float32)
    assert mx.allclose(got, original, atol=0.1 * float(mx.abs(original).max())).item()


def test_tied_qwen3_5_quantized_convert_keeps_identity(tiny_checkpoint, tmp_path):
    # tied embeddings: lm_head is embed_tokens.as_linear (a QuantizedEmbedding once
    # quantized); forward_with_hidden must still match the model bitwise.
    path = tiny_checkpoint("qwen3_5", tie_word_embeddings=True, head_in_sidecar=True)
    out = convert(path, tmp_path / "tied-q", quantize=True, q_group_size=32)
    for d in (path, out):
        model, tok, head, info = load_with_heads(d)
        x = mx.array([tok.encode(PROMPT)])
        ref = model(x, cache=make_prompt_cache(model))
        logits, hidden = forward_with_hidden(model, x, make_prompt_cache(model))
        assert mx.array_equal(ref, logits).item()
        assert mx.isfinite(head(hidden[:, :-1], x[:, 1:], head.make_cache())[0]).all().item()
    assert info.main_quantized and not info.head_quantized


@pytest.mark.parametrize("family", ["step3p5", "exaone_moe", "mimo_v2_flash"])
def test_windowed_fixtures_widen_their_per_layer_settings(family: str, tmp_path: Path) -> None:
    """A changed layer count resizes every per-layer list (the widened benches need it),
    keeping the head layers' entries last; mlx-lm builds the model from it."""
    from melix_mlx.tools import tiny_swa
    from melix_mlx.tools.tiny import make_tiny

    path = make_tiny(family, tmp_path / family, num_hidden_layers=5)
    config = json.loads((path / "config.json").read_text())
    default = tiny_swa.CONFIGS[family]
    for key in tiny_swa.PER_LAYER:
        if isinstance(default.get(key), list):
            extra = len(default[key]) - default["num_hidden_layers"]
            assert len(config[key]) == 5 + extra, key
            assert config[key][5:] == default[key][default["num_hidden_layers"] :], key
    model, _ = mlx_lm.load(str(path))
    assert len(model.layers) == 5
