"""Sidecar packs admitted by contract (melix_fsm.sidecar, melix_mlx.loading.sidecar).

The trained Qwen3.5-hybrid checkpoint is split into a head-less target and a
``qwen3_5_mtp`` pack (head tensors only, HF names, its own config.json):
- the trained pack passes every check (the probe agrees with the target's next-next
  token far above chance), the receipt admits it with ``validated: true`` and the checks
  recorded, and MTP decoding with it equals mlx-lm's greedy output;
- a pack is also found by convention beside the target (``<target>-mtp``);
- each way a pack can be wrong fails exactly its check, the receipt refuses it as
  ``unvalidated_sidecar`` naming that check, and loading raises ``UnvalidatedSidecar``:
  a random head of the right shapes (probe), a missing tensor (keys), a model offered as
  a pack (keys), a tensor of the wrong shape (shapes), another hidden size in the config
  (config), an integer tensor (dtypes), quantized tensors whose bits disagree with the
  declared quantization (quantization).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.checkpoints import EMBEDDED
from melix_mlx.loading.errors import UnvalidatedSidecar

from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import resolve
from melix_fsm.sidecar import CHECKS, CheckStatus, chance_p_value, report

SOURCE = EMBEDDED["stdlib-hybrid"]


def split(root: Path) -> tuple[Path, Path]:
    """(head-less target, pack) from the trained hybrid checkpoint."""
    target, pack = root / "target", root / "target-pack"
    skip = shutil.ignore_patterns("model.safetensors*", "training_report.json")
    shutil.copytree(SOURCE, target, ignore=skip)
    tensors = dict(mx.load(str(SOURCE / "model.safetensors")))
    main = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(target / "model.safetensors"), main, metadata={"format": "pt"})
    index = json.loads((SOURCE / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    pack.mkdir()
    head = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    mx.save_safetensors(str(pack / "mtp.safetensors"), head, metadata={"format": "pt"})
    text = json.loads((SOURCE / "config.json").read_text())["text_config"]
    pack_cfg = {"model_type": "qwen3_5_mtp", "architectures": ["Qwen3_5MTP"], "mtp_num_hidden_layers": 1}
    pack_cfg.update(hidden_size=text["hidden_size"], vocab_size=text["vocab_size"])
    (pack / "config.json").write_text(json.dumps(pack_cfg))
    return target, pack


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[Path, Path]:
    return split(tmp_path_factory.mktemp("sidecar"))


def edit_pack(pack: Path, dst: Path, tensors=None, config=None) -> Path:
    shutil.copytree(pack, dst)
    if tensors is not None:
        data = dict(mx.load(str(dst / "mtp.safetensors")))
        mx.eval(data)
        tensors(data)
        mx.save_safetensors(str(dst / "mtp.safetensors"), data, metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_the_target_alone_is_refused_for_missing_heads(parts):
    target, _ = parts
    assert resolve(target).refusal_reason is RefusalReason.missing_head_weights


def test_trained_pack_passes_and_decodes_exactly(parts):
    target, pack = parts
    model, _, head, info = load_with_heads(target, sidecar=pack)
    r = info.receipt
    assert r.mode == "accepted" and r.validated and info.refusal is None, r.message
    assert r.sidecar is not None and r.sidecar.validated and r.sidecar.failed_check is None
    assert [c.name for c in r.sidecar.checks] == list(CHECKS)
    assert all(c.status is CheckStatus.passed for c in r.sidecar.checks)
    probe = next(c for c in r.sidecar.checks if c.name == "probe")
    hits = int(probe.detail.split("/")[0])
    assert hits >= 10, probe.detail  # a trained head agrees far above chance (1/1024)
    assert info.sidecar and r.head_files == ["mtp.safetensors"] and r.weight_count > 0
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    got, decoder = mtp(model, head, prompt, 16, 2)
    assert got == reference(model, prompt, 16)
    assert decoder.stats["cycles"] > 0 and decoder.stats["refusal"] is None
    assert decoder.stats["accepted"] > 0  # the pack's head really drafts


def test_pack_found_by_convention(parts, tmp_path):
    target, pack = parts
    local = shutil.copytree(target, tmp_path / "model")
    shutil.copytree(pack, tmp_path / "model-mtp")
    _, _, _, info = load_with_heads(local)
    assert info.sidecar and info.receipt.sidecar.validated
    assert info.receipt.sidecar.path == str(tmp_path / "model-mtp")


def _random(data: dict) -> None:
    rng = np.random.default_rng(0)
    for k, v in data.items():
        noise = rng.normal(0, 0.02 if v.ndim > 1 else 0.1, v.shape).astype(np.float32)
        data[k] = mx.array(noise).astype(v.dtype)


def _drop_one(data: dict) -> None:
    data.pop("mtp.fc.weight")


def _add_model_tensor(data: dict) -> None:
    data["model.language_model.norm.weight"] = mx.ones((128,))


def _wrong_shape(data: dict) -> None:
    data["mtp.fc.weight"] = data["mtp.fc.weight"][:, :100]


def _int_tensor(data: dict) -> None:
    data["mtp.norm.weight"] = data["mtp.norm.weight"].astype(mx.int32)


def _quantized_8bit(data: dict) -> None:
    w = data.pop("mtp.fc.weight")
    q, scales, biases = mx.quantize(w, group_size=64, bits=8)
    data.update({"mtp.fc.weight": q, "mtp.fc.scales": scales, "mtp.fc.biases": biases})


BAD = [
    ("probe", _random, None),
    ("keys", _drop_one, None),
    ("keys", _add_model_tensor, None),
    ("shapes", _wrong_shape, None),
    ("config", None, lambda c: c.update(hidden_size=64)),
    ("config", None, lambda c: c.update(model_type="deepseek_v3_mtp")),
    ("dtypes", _int_tensor, None),
    ("quantization", _quantized_8bit, lambda c: c.update(quantization={"group_size": 64, "bits": 4})),
]


@pytest.mark.parametrize("check,tensors,config", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_pack_fails_its_check_and_is_refused(parts, tmp_path, check, tensors, config):
    target, pack = parts
    bad = edit_pack(pack, tmp_path / "bad", tensors, config)
    with pytest.raises(UnvalidatedSidecar) as info:
        load_with_heads(target, sidecar=bad)
    exc = info.value
    assert exc.reason is RefusalReason.unvalidated_sidecar
    assert exc.report.failed_check == check and not exc.report.validated
    assert f"check {check!r} failed" in str(exc)
    statuses = {c.name: c.status for c in exc.report.checks}
    later = CHECKS[CHECKS.index(check) + 1 :]
    assert statuses[check] is CheckStatus.failed and all(statuses[n] is CheckStatus.not_run for n in later)
    receipt = exc.receipt
    assert receipt.mode == "refused" and receipt.refusal_reason is RefusalReason.unvalidated_sidecar
    assert f"check {check!r} failed" in receipt.message and receipt.sidecar == exc.report


def test_report_and_chance_helpers():
    r = report("p", {"config": (True, "ok"), "keys": (False, "missing")})
    assert r.failed_check == "keys" and not r.validated
    assert [c.status for c in r.checks][2:] == [CheckStatus.not_run] * (len(CHECKS) - 2)
    unfinished = report("p", {"config": (True, "ok")})  # a contract not run to the end never passes
    assert not unfinished.validated and unfinished.failed_check == "keys"
    assert chance_p_value(0, 30, 0.01) == 1.0
    assert chance_p_value(3, 30, 1 / 1024) < 1e-3 < chance_p_value(1, 30, 1 / 1024)
    with pytest.raises(ValueError):
        report("p", {"vibes": (True, "")})


def test_cli_generate_with_mtp_sidecar(parts, tmp_path, capsys):
    from test_decode_cli import FORCE_ON, greedy, run_json

    target, pack = parts
    common = ("generate", "--model", str(target), "--prompt", "Hi there", "--json", "--max-tokens", "12")
    status, [out], _ = run_json(capsys, *common, "--mtp-sidecar", str(pack), *FORCE_ON)
    assert status == 0 and out["method"] == "mtp"
    assert out["receipt"]["mode"] == "accepted" and out["receipt"]["sidecar"]["validated"]
    assert out["tokens"] == greedy(SOURCE, "Hi there", 12) and out["stats"]["cycles"] > 0
    bad = edit_pack(pack, tmp_path / "bad", _random)
    status, [out], _ = run_json(capsys, *common, "--mtp-sidecar", str(bad), "--method", "mtp", *FORCE_ON)
    assert status == 3 and out["error"] == "unvalidated_sidecar"
    assert out["receipt"]["sidecar"]["failed_check"] == "probe"
    status, [out], err = run_json(capsys, *common, "--mtp-sidecar", str(bad), *FORCE_ON)
    assert status == 0 and out["method"] == "none" and out["stats"]["cycles"] == 0
    assert "unvalidated_sidecar" in err and out["tokens"] == greedy(SOURCE, "Hi there", 12)
    local = shutil.copytree(target, tmp_path / "model")  # by convention: <model>-mtp beside it
    shutil.copytree(pack, tmp_path / "model-mtp")
    status, [out], _ = run_json(capsys, "generate", "--model", str(local), *common[3:], *FORCE_ON)
    assert status == 0 and out["receipt"]["sidecar"]["path"] == str(tmp_path / "model-mtp")
    assert out["method"] == "mtp" and out["stats"]["cycles"] > 0


def test_converted_format_pack_passes(parts, tmp_path):
    """A pack in the project's converted format (``melix_mtp.*``, norms already repaired)."""
    from melix_mlx.loading.convert import convert

    target, _ = parts
    converted = convert(SOURCE, tmp_path / "converted")
    pack = tmp_path / "pack"
    pack.mkdir()
    shutil.copy(converted / "mtp.safetensors", pack / "mtp.safetensors")
    record = json.loads((converted / "config.json").read_text())["melix_mtp"]
    (pack / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp", "melix_mtp": record}))
    model, _, head, info = load_with_heads(target, sidecar=pack)
    assert info.receipt.sidecar.validated, info.receipt.message
    assert info.head_format == "melix" and not info.norms_repaired_on_load
    prompt = [72, 101, 108, 108, 111]
    got, decoder = mtp(model, head, prompt, 12, 2)
    assert got == reference(model, prompt, 12) and decoder.stats["accepted"] > 0
