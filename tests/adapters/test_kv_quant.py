"""Quantized KV cache (mlx-lm's kv_bits / kv_group_size / quantized_kv_start) with MTP.

Single sequence: output equals mlx-lm's own quantized-KV `generate_step` token for token,
at depths 1-3, with the KV cache quantized from the start and from a start inside the
generation (where a verify must not straddle the boundary). The 4-bit reference differs
from the unquantized one, so these comparisons see whether quantization is applied.
Where it cannot run (MLA layers; batch caches, which mlx-lm cannot merge when quantized)
the refusal is typed `unsupported_quantization`, from the registry, before any weight.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.loading import load_with_heads
from melix_mlx.runtime.hidden import main_parts
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import QuantizedKVCache
from scripted_head import ScriptedHead

from melix_fsm.checkpoint import read_checkpoint
from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import Mode, ServingContext, resolve

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
N = 24
GROUP = 32  # the tiny checkpoints' head dim is 32 with hidden_size 128


@pytest.fixture(scope="module")
def mimo(tiny_checkpoint) -> tuple:
    path = tiny_checkpoint("mimo", hidden_size=128)
    return (path, *load_with_heads(path))


def _check_identity(model, head, bits: int, start: int) -> list[int]:
    kw = {"kv_bits": bits, "kv_group_size": GROUP, "quantized_kv_start": start}
    want = reference(model, PROMPT, N, **kw)
    longer = reference(model, PROMPT, N + 4, **kw)
    scripted = ScriptedHead([PROMPT + longer], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    pauses = []
    for k in (1, 2, 3):
        for drafter in (head, scripted):
            got, decoder = mtp(model, drafter, PROMPT, N, k, **kw)
            assert got == want, (bits, start, k)
            assert any(isinstance(c, QuantizedKVCache) for c in decoder.cache)
            # a cycle that would end exactly at the start gives way to one plain step
            assert decoder.stats["suspensions"] == decoder.stats["resumptions"] <= 1
            pauses.append(decoder.stats["suspensions"])
        assert decoder.stats["accepted"] > 0 and decoder.stats["rollbacks"] > 0
    assert any(pauses) == (len(PROMPT) < start < len(PROMPT) + N)
    return want


@pytest.mark.parametrize("start", [0, 13])
@pytest.mark.parametrize("bits", [4, 8])
def test_single_sequence_equals_mlx_lm_quantized_kv(mimo, bits: int, start: int) -> None:
    _, model, _, head, _ = mimo
    want = _check_identity(model, head, bits, start)
    if bits == 4:  # the reference itself changes: the comparison above can fail
        assert want != reference(model, PROMPT, N)


def test_boundary_is_needed(mimo, monkeypatch) -> None:
    """Without the cap at quantized_kv_start a verify straddles it and output diverges."""
    from melix_mlx.decode import MTPDecoder

    _, model, _, _, _ = mimo
    kw = {"kv_bits": 2, "kv_group_size": GROUP, "quantized_kv_start": 9}
    want = reference(model, PROMPT, N, **kw)
    scripted = ScriptedHead(
        [PROMPT + reference(model, PROMPT, N + 4, **kw)], VOCAB_SIZE, main_parts(model).args.hidden_size
    )
    assert mtp(model, scripted, PROMPT, N, 2, **kw)[0] == want
    monkeypatch.setattr(MTPDecoder, "_room_before_quantization", lambda self: None)
    assert mtp(model, scripted, PROMPT, N, 2, **kw)[0] != want


def test_hybrid_recurrent_layers_with_quantized_kv(tiny_checkpoint) -> None:
    model, _, head, _ = load_with_heads(tiny_checkpoint("qwen3_5", head_dim=32))
    kw = {"kv_bits": 4, "kv_group_size": GROUP, "quantized_kv_start": 0}
    want = reference(model, PROMPT, N, **kw)
    longer = reference(model, PROMPT, N + 4, **kw)
    scripted = ScriptedHead([PROMPT + longer], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    got, decoder = mtp(model, scripted, PROMPT, N, 2, **kw)
    assert got == want and decoder.stats["rollbacks"] > 0


def test_stream_generate_takes_mlx_lm_arguments(mimo) -> None:
    from melix_mlx.generate import mtp_stream_generate
    from mlx_lm.generate import stream_generate

    _, model, tokenizer, head, _ = mimo
    kw = {"kv_bits": 4, "kv_group_size": GROUP, "quantized_kv_start": 0}
    want = [r.token for r in stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=N, **kw)]
    out = list(mtp_stream_generate(model, tokenizer, PROMPT, head, N, num_draft_tokens=2, **kw))
    assert [r.token for r in out] == want
    assert out[-1].stats["refusal"] is None


def test_mla_refused_from_registry(tiny_checkpoint) -> None:
    """The registry says MLA cannot quantize its cache; mlx-lm itself fails there too."""
    from melix_fsm.registry import registry

    path = tiny_checkpoint("deepseek_v3")
    assert registry().family_for("deepseek_v3").quantized_kv_cache is False
    receipt = resolve(path, speculative_config(), context=ServingContext(quantized_kv=True))
    assert receipt.mode is Mode.refused and receipt.refusal_reason is RefusalReason.unsupported_quantization
    assert "MLA" in receipt.message and receipt.caches == []  # refused before the rollback plan
    assert resolve(path, speculative_config()).mode is Mode.accepted  # the cache was the only problem
    model, _, _, _ = load_with_heads(path)
    with pytest.raises((ValueError, AttributeError, TypeError)):
        reference(model, PROMPT, 4, kv_bits=8, kv_group_size=GROUP, quantized_kv_start=0)


def test_batched_quantized_kv_refused_typed(mimo) -> None:
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.loading.errors import UnsupportedServing

    path, model, _, head, _ = mimo
    batched = ServingContext(quantized_kv=True, batched=True)
    receipt = resolve(path, speculative_config(), context=batched)
    assert receipt.refusal_reason is RefusalReason.unsupported_quantization and receipt.batched
    single = ServingContext(quantized_kv=True)
    assert resolve(path, speculative_config(), context=single).mode is Mode.accepted
    with pytest.raises(UnsupportedServing) as err:
        MTPBatchGenerator(model, head, kv_bits=4)
    assert err.value.reason is RefusalReason.unsupported_quantization
    assert read_checkpoint(path).model_type == "mimo"


def test_cli_kv_bits_single_equals_mlx_lm(mimo, capsys) -> None:
    from melix_fsm.cli import main

    path, model, _, _, _ = mimo
    argv = ["generate", "--model", str(path), "--prompt", "Hello, w", "--max-tokens", str(N), "--json"]
    argv += ["--kv-bits", "4", "--kv-group-size", str(GROUP), "--quantized-kv-start", "0"]
    argv += ["--device-policy", "force_on", "--num-draft-tokens", "2"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "mtp" and result["receipt"]["quantized_kv"] is True
    want = reference(model, PROMPT, N, kv_bits=4, kv_group_size=GROUP, quantized_kv_start=0)
    assert result["tokens"] == want[: len(result["tokens"])] and result["tokens"]


def test_cli_refuses_what_nothing_can_run(mimo, tiny_checkpoint, tmp_path, capsys) -> None:
    from melix_fsm.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nimport os\n")
    batched = ["generate", "--model", str(mimo[0]), "--prompts-file", str(prompts), "--kv-bits", "4"]
    mla = ["generate", "--model", str(tiny_checkpoint("deepseek_v3")), "--prompt", "x", "--kv-bits", "8"]
    for argv in (batched, mla, [*mla, "--method", "none"]):
        assert main(argv) == 3
        captured = capsys.readouterr()
        assert json.loads(captured.out)["error"] == "unsupported_quantization"
        assert "Traceback" not in captured.err


def test_group_size_not_dividing_the_head_dim_is_refused_before_weights(mimo, monkeypatch, capsys) -> None:
    """mlx cannot quantize a 32-wide head in groups of 64: refused from config.json, typed."""
    from melix_mlx.loading import method_load

    from melix_fsm.cli import main

    path, model, _, _, _ = mimo
    with pytest.raises(ValueError):  # the refusal is not spurious: mlx-lm's own decode fails
        reference(model, PROMPT, 4, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    bad = ServingContext(quantized_kv=True, kv_group_size=64)
    receipt = resolve(path, speculative_config(), context=bad)
    assert receipt.refusal_reason is RefusalReason.unsupported_quantization
    assert "kv_group_size 64" in receipt.message and "head dim 32" in receipt.message
    good = ServingContext(quantized_kv=True, kv_group_size=GROUP)
    assert resolve(path, speculative_config(), context=good).mode is Mode.accepted

    def forbidden(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(method_load, "load_plain", forbidden)
    monkeypatch.setattr(method_load, "load_for_method", forbidden)
    flags = ["--kv-bits", "4", "--kv-group-size", "64"]
    assert main(["receipt", str(path), *flags]) == 3
    assert json.loads(capsys.readouterr().out)["refusal_reason"] == "unsupported_quantization"
    for method in ([], ["--method", "none"]):  # plain decoding cannot run it either
        assert main(["generate", "--model", str(path), "--prompt", "x", *flags, *method]) == 3
        captured = capsys.readouterr()
        assert json.loads(captured.out)["error"] == "unsupported_quantization"
        assert "kv_group_size 64" in captured.err
    assert main(["generate", "--model", str(path), "--prompt", "x", "--quantized-kv"]) == 3  # default 64
    assert "kv_group_size 64" in capsys.readouterr().err


def test_library_decoder_refuses_a_group_size_not_dividing_the_head_dim(mimo) -> None:
    """The API path too: typed at construction, before any forward (mlx would fail mid-decode)."""
    from melix_mlx.decode import MTPDecoder
    from melix_mlx.loading.errors import UnsupportedServing

    _, model, _, head, _ = mimo
    with pytest.raises(UnsupportedServing) as info:
        MTPDecoder(model, head, kv_bits=4, kv_group_size=64)
    assert info.value.reason is RefusalReason.unsupported_quantization
    assert "head dim 32" in str(info.value)
    MTPDecoder(model, head, kv_bits=4, kv_group_size=GROUP)  # a dividing group is accepted
