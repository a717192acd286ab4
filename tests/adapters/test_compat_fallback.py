"""Plain fallback everywhere: what mlx-lm can load decodes plainly, with a receipt saying why.

A model without an MTP head (a tiny llama) and an MTP-only sidecar directory decode
through `melix-fsm generate` (default method and `--method none`) and through the API,
token for token as mlx-lm decodes them; the receipt is printed on every start (stderr
without --json) and names the typed reason; an explicit `--method mtp` exits 3; a
checkpoint mlx-lm cannot load is a one-line error, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from compat_models import make_llama, make_sidecar
from decode_refs import reference
from melix_mlx.loading.checkpoints import resolve_model
from mlx_lm.utils import load_model

from melix_fsm.cli import main

PROMPT = "import os"
N = 12
RECEIPT_PREFIX = "melix-fsm generate: receipt: "


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("compat") / "llama")


@pytest.fixture(scope="module")
def sidecar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sidecar(resolve_model("stdlib-tiny"), tmp_path_factory.mktemp("compat") / "sidecar")


def _stderr_receipt(err: str) -> dict:
    lines = [line for line in err.splitlines() if line.startswith(RECEIPT_PREFIX)]
    assert len(lines) == 1, err
    return json.loads(lines[0][len(RECEIPT_PREFIX) :])


def _want(path: Path) -> list[int]:
    from mlx_lm.utils import load_tokenizer

    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    tokens = reference(model, tokenizer.encode(PROMPT), N)
    return tokens[: tokens.index(0)] if 0 in tokens else tokens  # EOS (id 0) ends the output


@pytest.mark.parametrize("which", ["llama", "sidecar"])
@pytest.mark.parametrize("method", [None, "none"])
def test_generate_decodes_plainly_with_receipt(llama_dir, sidecar_dir, which, method, capsys) -> None:
    path = llama_dir if which == "llama" else sidecar_dir
    reason = "unsupported_model" if which == "llama" else "unvalidated_sidecar"
    argv = ["generate", "--model", str(path), "--prompt", PROMPT, "--max-tokens", str(N)]
    argv += ["--method", method] if method else []
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "none" and result["tokens"] == _want(path)
    receipt = result["receipt"]
    if method is None:
        assert receipt["mode"] == "refused" and receipt["refusal_reason"] == reason
        assert result["stats"]["refusal_reason"] == reason
    else:
        assert receipt["mode"] == "legacy_only" and reason in receipt["message"]
        assert result["stats"]["refusal_reason"] == "operator_disabled"
    # without --json: text on stdout, with --receipt the same receipt as one JSON line on stderr
    assert main([*argv, "--receipt"]) == 0
    captured = capsys.readouterr()
    assert _stderr_receipt(captured.err) == receipt and "Traceback" not in captured.err
    # without --receipt: a one-line summary instead, saying it decoded plainly and why
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert RECEIPT_PREFIX not in err
    summary = err.splitlines()[-1]
    assert summary.startswith("melix-fsm generate: plain decode (")
    assert f"{len(result['tokens'])} tokens" in summary


def test_explicit_mtp_on_a_headless_model_exits_3(llama_dir, capsys) -> None:
    argv = ["generate", "--model", str(llama_dir), "--prompt", PROMPT, "--method", "mtp"]
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"] == "unsupported_model" and "Traceback" not in captured.err


def test_receipt_printed_on_an_admitted_start(capsys) -> None:
    argv = ["generate", "--model", "stdlib-tiny", "--prompt", PROMPT, "--max-tokens", "4"]
    assert main([*argv, "--device-policy", "force_on", "--receipt"]) == 0
    receipt = _stderr_receipt(capsys.readouterr().err)
    assert receipt["mode"] == "accepted" and receipt["hardware_gate"] == "admitted"


def test_unloadable_checkpoint_is_one_line_not_a_traceback(llama_dir, tmp_path, capsys) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    assert main(["generate", "--model", str(broken), "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    assert "cannot load" in err and "Traceback" not in err


def test_api_decodes_plainly_without_a_head(llama_dir) -> None:
    from melix_mlx.generate import mtp_stream_generate
    from mlx_lm.utils import load_tokenizer

    model, _ = load_model(llama_dir)
    tokenizer = load_tokenizer(llama_dir)
    out = list(mtp_stream_generate(model, tokenizer, PROMPT, None, N))
    tokens = [r.token for r in out if r.finish_reason != "stop"]
    assert tokens == _want(llama_dir)
    assert out[-1].stats["refusal_reason"] == "unsupported_model" and out[-1].stats["cycles"] == 0
