"""MTP head repositories (the split-drafter layout) admitted as sidecar packs.

The target is an mlx-community-style conversion of the embedded ``stdlib-hybrid``
(mlx-lm's own ``convert``: its sanitize drops the head); the pack is that checkpoint's
head written by ``head_pack.write_pack`` in the layout mlx-vlm's ``split_mtp`` writes
(``model_type`` ``qwen3_5_mtp``, ``block_size``, the source's ``text_config``; tensors
with ``mtp.`` stripped, norms already +1; the tokenizer):
- the layout is exactly mlx-vlm's (compared tensor by tensor when mlx-vlm is installed);
- the pack passes every check of the contract, builds the very head the source's own
  tensors build (every parameter equal), loads with ``head_format`` ``split`` and
  no norm repair, and MTP decoding with it equals mlx-lm's greedy output, with the same
  tokens and the same acceptance as the original checkpoint with its own head;
- it is found by convention beside the target and drives ``generate`` from the CLI;
- a pack whose probe fails stays a typed refusal: raw (unrepaired) norms fail the
  probe, a wrong shape fails shapes, an embedding shipped in the pack fails keys,
  another family's text_config fails config.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import EMBEDDED
from melix_mlx.loading.errors import UnsupportedModel, UnvalidatedSidecar
from melix_mlx.loading.head_pack import PACK_FILE, write_pack
from mlx.utils import tree_flatten

from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import resolve
from melix_fsm.sidecar import CHECKS, CheckStatus

SOURCE = EMBEDDED["stdlib-hybrid"]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[Path, Path]:
    """(head-less mlx-lm conversion, split-drafter pack of the source's head)."""
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("packs")
    convert(str(SOURCE), str(root / "target"))
    return root / "target", write_pack(SOURCE, root / "pack")


def edit(pack: Path, dst: Path, tensors=None, config=None) -> Path:
    shutil.copytree(pack, dst)
    if tensors is not None:
        data = dict(mx.load(str(dst / PACK_FILE)))
        tensors(data)
        mx.save_safetensors(str(dst / PACK_FILE), data, metadata={"format": "mlx"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_layout(parts):
    target, pack = parts
    assert not any(k.startswith("mtp.") for k in mx.load(str(target / "model.safetensors")))
    assert resolve(target).refusal_reason is RefusalReason.missing_head_weights
    cfg = json.loads((pack / "config.json").read_text())
    source_cfg = json.loads((SOURCE / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_mtp" and cfg["block_size"] == 3
    assert cfg["text_config"] == source_cfg["text_config"]
    assert (pack / "tokenizer.json").is_file() and (pack / "tokenizer_config.json").is_file()
    tensors = mx.load(str(pack / PACK_FILE))
    raw = mx.load(str(SOURCE / "model.safetensors"))
    assert set(tensors) == {k.removeprefix("mtp.") for k in raw if k.startswith("mtp.")}
    for name in (*NORMS, "layers.0.input_layernorm.weight", "layers.0.self_attn.q_norm.weight"):
        assert mx.array_equal(tensors[name], raw[f"mtp.{name}"] + 1.0), name  # norms already +1
    assert mx.array_equal(tensors["fc.weight"], raw["mtp.fc.weight"])


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny random qwen3_5_moe checkpoint with 2 head layers, its pack)."""
    from melix_mlx.tools.tiny import make_tiny

    root = tmp_path_factory.mktemp("moe")
    source = make_tiny("qwen3_5_moe", root / "source", mtp_layers=2)
    return source, write_pack(source, root / "pack")


@pytest.mark.skipif(importlib.util.find_spec("mlx_vlm") is None, reason="mlx-vlm is not installed")
@pytest.mark.parametrize("which", ["hybrid", "moe"])
def test_the_layout_is_mlx_vlms(parts, moe, tmp_path, which):
    from mlx_vlm.split_mtp import split_mtp

    source, pack = (SOURCE, parts[1]) if which == "hybrid" else moe
    theirs = split_mtp(str(source), str(tmp_path / "theirs"))
    a, b = mx.load(str(theirs / "model.safetensors")), mx.load(str(pack / PACK_FILE))
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]) for k in a)
    assert json.loads((theirs / "config.json").read_text()) == json.loads((pack / "config.json").read_text())


def test_pack_passes_and_decodes_as_the_original(parts):
    target, pack = parts
    model, _, head, info = load_with_heads(target, sidecar=pack)
    r = info.receipt
    assert r.mode == "accepted" and r.validated and r.sidecar.validated, r.message
    assert [c.status for c in r.sidecar.checks] == [CheckStatus.passed] * len(CHECKS)
    assert info.sidecar and info.head_format == "split" and not info.norms_repaired_on_load
    assert r.head_files == [PACK_FILE]
    got, decoder = mtp(model, head, PROMPT, 16, 2)
    assert got == reference(model, PROMPT, 16)
    own_model, _, own_head, own_info = load_with_heads(SOURCE)
    assert not own_info.sidecar
    ours, theirs = dict(tree_flatten(head.parameters())), dict(tree_flatten(own_head.parameters()))
    assert sorted(ours) == sorted(theirs) and all(mx.array_equal(ours[k], theirs[k]) for k in ours)
    want, own = mtp(own_model, own_head, PROMPT, 16, 2)
    assert got == want and decoder.stats["accepted"] > 0
    for key in ("cycles", "proposed", "accepted", "per_position_acceptance"):
        assert decoder.stats[key] == own.stats[key], key


def test_pack_by_convention_and_from_the_cli(parts, tmp_path, capsys):
    from test_decode_cli import FORCE_ON, greedy, run_json

    target, pack = parts
    local = shutil.copytree(target, tmp_path / "model")
    shutil.copytree(pack, tmp_path / "model-mtp")
    argv = ("generate", "--model", str(local), "--prompt", "Hi there", "--json", "--max-tokens", "12")
    status, [out], _ = run_json(capsys, *argv, *FORCE_ON)
    assert status == 0 and out["method"] == "mtp" and out["stats"]["cycles"] > 0
    sidecar = out["receipt"]["sidecar"]
    assert sidecar["validated"] and sidecar["path"] == str(tmp_path / "model-mtp")
    assert out["tokens"] == greedy(SOURCE, "Hi there", 12)


def _raw_norms(data: dict) -> None:
    for k in list(data):
        if k.endswith(NORMS) or k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
            data[k] = data[k] - 1.0  # as stored upstream, never repaired


def _wrong_shape(data: dict) -> None:
    data["fc.weight"] = data["fc.weight"][:, :100]


def _embedding(data: dict) -> None:
    data["embed_tokens.weight"] = mx.zeros((1024, 128))


BAD = [
    ("probe", _raw_norms, None),
    ("shapes", _wrong_shape, None),
    ("keys", _embedding, None),
    ("config", None, lambda c: c["text_config"].update(model_type="deepseek_v3")),
    ("config", None, lambda c: c["text_config"].update(hidden_size=64)),
]


@pytest.mark.parametrize("check,tensors,config", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_pack_is_a_typed_refusal(parts, tmp_path, check, tensors, config):
    target, pack = parts
    bad = edit(pack, tmp_path / "bad", tensors, config)
    with pytest.raises(UnvalidatedSidecar) as info:
        load_with_heads(target, sidecar=bad)
    exc = info.value
    assert exc.reason is RefusalReason.unvalidated_sidecar and exc.report.failed_check == check
    assert exc.receipt.mode == "refused" and f"check {check!r} failed" in exc.receipt.message


def test_writer_refuses_a_checkpoint_without_a_head(parts, tmp_path):
    from melix_mlx.loading.errors import HeadLoadError

    target, _ = parts
    with pytest.raises(HeadLoadError):
        write_pack(target, tmp_path / "none")
    assert issubclass(UnsupportedModel, HeadLoadError)


def test_cli_convert_split_head(parts, tmp_path, capsys):
    from melix_fsm.cli import main

    target, pack = parts
    assert main(["convert", "--split-head", "stdlib-hybrid", str(tmp_path / "pack")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "pack")
    ours, want = mx.load(str(tmp_path / "pack" / PACK_FILE)), mx.load(str(pack / PACK_FILE))
    assert sorted(ours) == sorted(want) and all(mx.array_equal(ours[k], want[k]) for k in ours)
    assert main(["convert", "--split-head", str(target), str(tmp_path / "none")]) == 3  # no head to split
    assert "missing_head_weights" in capsys.readouterr().err


def test_moe_pack_with_two_layers_builds_the_checkpoints_head(moe):
    """Experts stacked, two head layers: each layer equals the one the checkpoint's own
    tensors build; the contract passes every structural check (the random head then fails
    its probe, as it must)."""
    from melix_mlx.loading.head_pack import split_layers
    from melix_mlx.loading.head_weights import build_layer
    from melix_mlx.loading.sidecar import validate_pack

    source, pack = moe
    assert json.loads((pack / "config.json").read_text())["model_type"] == "qwen3_5_mtp"
    model, tokenizer, own, info = load_with_heads(source)
    assert info.head_layers == 2
    tensors = mx.load(str(pack / PACK_FILE))
    assert "layers.1.mlp.switch_mlp.gate_proj.weight" in tensors
    for j, weights in split_layers(tensors, "qwen3_5_moe", 2, pack).items():
        head = build_layer(model, "qwen3_5_moe", weights, None, pack)[0]
        ours, theirs = dict(tree_flatten(head.parameters())), dict(tree_flatten(own.heads[j].parameters()))
        assert sorted(ours) == sorted(theirs) and all(mx.array_equal(ours[k], theirs[k]) for k in ours), j
    result, _ = validate_pack(source, pack, model, tokenizer)
    assert result.failed_check == "probe"
