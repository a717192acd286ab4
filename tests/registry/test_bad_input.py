"""Bad input: each case is a typed refusal or a usage error with a clear message, never a traceback.

Every case goes through both the API (`resolve`) and the CLI (`melix_fsm.cli.main`), and
checks the refusal reason, the exit status and a message naming the problem.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from melix_fsm.cli import EXIT_REFUSED, EXIT_USAGE, main
from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import resolve

from .conftest import Fakes, write_safetensors

U = RefusalReason.unreadable_checkpoint

Setup = Callable[[Path], None]


def _config_bytes(data: bytes) -> Setup:
    return lambda p: (p / "config.json").write_bytes(data)


def _huge_config(p: Path) -> None:
    with open(p / "config.json", "wb") as f:  # sparse: 100 MB without writing them
        f.truncate(100 * 2**20)


def _config_loop(p: Path) -> None:
    (p / "config.json").unlink()
    os.symlink("config.json", p / "config.json")


def _shard_loop(p: Path) -> None:
    os.symlink("loop.safetensors", p / "loop.safetensors")


def _dir_loop(p: Path) -> None:
    os.symlink(p / "sub", p / "sub")


def _missing_shard(p: Path) -> None:
    index = {"weight_map": {"a.weight": "model-00009-of-00009.safetensors"}}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_escape(p: Path) -> None:
    index = {"weight_map": {"a.weight": "../../etc/passwd"}}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_not_object(p: Path) -> None:
    (p / "model.safetensors.index.json").write_text("[1, 2]")


def _header(raw: bytes) -> Setup:
    return lambda p: (p / "model.safetensors").write_bytes(raw)


def _truncated_data(p: Path) -> None:
    raw = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(raw[:-3])


def _bad_offsets(p: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (p / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def _no_weights(p: Path) -> None:
    (p / "model.safetensors").unlink()


def _melix_escape(p: Path) -> None:
    cfg = json.loads((p / "config.json").read_text())
    cfg["melix_mtp"] = {"file": "/etc/hosts"}
    (p / "config.json").write_text(json.dumps(cfg))


CASES: list[tuple[str, Setup, RefusalReason, str]] = [
    ("config missing", lambda p: (p / "config.json").unlink(), U, "config.json does not exist"),
    ("config empty", _config_bytes(b""), U, "is empty"),
    ("config whitespace", _config_bytes(b"  \n"), U, "is empty"),
    ("config not JSON", _config_bytes(b"{model_type: mimo"), U, "not valid JSON"),
    ("config not UTF-8", _config_bytes(b'{"model_type": "\xff\xfe"}'), U, "not UTF-8"),
    ("config array", _config_bytes(b"[1, 2, 3]"), U, "must be a JSON object, got list"),
    ("config string", _config_bytes(b'"mimo"'), U, "must be a JSON object, got str"),
    ("config 100 MB", _huge_config, U, "over the"),
    ("config deeply nested", _config_bytes(b"[" * 100_000 + b"]" * 100_000), U, "nests"),
    ("config huge integer", _config_bytes(b'{"vocab_size": ' + b"9" * 5000 + b"}"), U, "not valid JSON"),
    ("config symlink loop", _config_loop, U, "cannot be read"),
    (
        "config is a directory",
        lambda p: ((p / "config.json").unlink(), (p / "config.json").mkdir()),
        U,
        "directory",
    ),
    ("shard symlink loop", _shard_loop, U, "cannot be read"),
    ("index names missing shard", _missing_shard, U, "model-00009-of-00009.safetensors"),
    ("index escapes the directory", _index_escape, U, "not a file name inside"),
    ("index not an object", _index_not_object, U, "weight_map"),
    ("header empty file", _header(b""), U, "truncated"),
    ("header 3 bytes", _header(b"\x01\x02\x03"), U, "truncated"),
    ("header length beyond file", _header(struct.pack("<Q", 500) + b"{}"), U, "truncated"),
    ("header absurd length", _header(struct.pack("<Q", 2**63) + b"{}"), U, "limit"),
    ("header garbage", _header(struct.pack("<Q", 6) + b"\x00\xffgarb"), U, "header"),
    ("header not JSON", _header(struct.pack("<Q", 6) + b"{nope}"), U, "not valid JSON"),
    ("header is a list", _header(struct.pack("<Q", 2) + b"[]"), U, "must be a JSON object"),
    ("tensor entry not object", _header(struct.pack("<Q", 8) + b'{"w": 1}'), U, "not an object"),
    ("tensor data truncated", _truncated_data, U, "truncated"),
    ("tensor size disagrees", _bad_offsets, U, "needs 8 bytes"),
    ("no weight files", _no_weights, U, "no *.safetensors"),
    ("melix file outside dir", _melix_escape, U, "not a file name inside"),
    (
        "head count negative",
        lambda p: _set(p, num_nextn_predict_layers=-1),
        RefusalReason.invalid_config,
        "-1",
    ),
    (
        "head count zero",
        lambda p: _set(p, num_nextn_predict_layers=0),
        RefusalReason.unsupported_model,
        "no MTP",
    ),
    (
        "head count string",
        lambda p: _set(p, num_nextn_predict_layers="1"),
        RefusalReason.invalid_config,
        "'1'",
    ),
    (
        "head count absurd",
        lambda p: _set(p, num_nextn_predict_layers=10**6),
        RefusalReason.invalid_config,
        "outside",
    ),
    ("no model_type", lambda p: _set(p, model_type=None), RefusalReason.invalid_config, "model_type"),
    ("model_type a number", lambda p: _set(p, model_type=7), RefusalReason.invalid_config, "model_type"),
]


def _set(p: Path, **values: object) -> None:
    cfg = json.loads((p / "config.json").read_text())
    cfg.update(values)
    (p / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("setup,reason,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_checkpoint(
    fakes: Fakes, capsys: pytest.CaptureFixture[str], setup: Setup, reason: RefusalReason, text: str
) -> None:
    path = fakes.make("mimo")
    setup(path)
    receipt = resolve(path)
    assert receipt.refusal_reason is reason, receipt.message
    assert text in receipt.message
    status = main(["receipt", str(path)])
    out, err = capsys.readouterr()
    assert status == (EXIT_USAGE if reason is U else EXIT_REFUSED)
    assert json.loads(out)["refusal_reason"] == reason.value
    assert reason.value in err and "Traceback" not in err


def test_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    receipt = resolve(tmp_path / "absent")
    assert receipt.refusal_reason is U and "not a readable directory" in receipt.message
    assert main(["receipt", str(tmp_path / "absent")]) == EXIT_USAGE
    assert "not a readable directory" in capsys.readouterr().err


def test_model_dir_symlink_loop(tmp_path: Path) -> None:
    _dir_loop(tmp_path)
    assert resolve(tmp_path / "sub").refusal_reason is U


def test_model_dir_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("{}")
    assert resolve(tmp_path / "f").refusal_reason is U


def test_draft_model_with_different_vocabulary(fakes: Fakes, capsys: pytest.CaptureFixture[str]) -> None:
    target = fakes.make("llama")
    draft = fakes.make("llama")
    (draft / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"x": 0, "y": 1}}}))
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.refusal_reason is RefusalReason.vocab_mismatch
    status = main(["receipt", str(target), "--method", "draft_model", "--draft-model", str(draft)])
    assert status == EXIT_REFUSED and "vocab_mismatch" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content,text",
    [(b"\xff", "not UTF-8"), (b"{", "not valid JSON"), (b'{"model": {"vocab": 3}}', "model.vocab")],
)
def test_draft_model_with_corrupt_tokenizer(fakes: Fakes, content: bytes, text: str) -> None:
    target, draft = fakes.make("llama"), fakes.make("llama")
    (draft / "tokenizer.json").write_bytes(content)
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.refusal_reason is U and text in r.message


def test_weights_with_only_metadata_header(fakes: Fakes) -> None:
    path = fakes.make("mimo")
    write_safetensors(path / "model.safetensors", [], {"format": "pt"})
    r = resolve(path)
    assert r.refusal_reason is RefusalReason.missing_head_weights


def test_safetensors_header_is_the_one_checked_reader(tmp_path: Path) -> None:
    """Names, dtypes and shapes come from one hardened header reader (the loader uses it too)."""
    from melix_fsm.checkpoint import safetensors_header, safetensors_keys
    from melix_fsm.errors import CheckpointError

    path = tmp_path / "m.safetensors"
    write_safetensors(path, ["a.weight", "b.bias"], metadata={"format": "pt"})
    assert safetensors_header(path) == {"a.weight": ("F32", (1,)), "b.bias": ("F32", (1,))}
    assert safetensors_keys(path) == ["a.weight", "b.bias"]
    path.write_bytes(path.read_bytes()[:-3])  # data cut short
    with pytest.raises(CheckpointError, match="truncated"):
        safetensors_header(path)
