"""The library fails closed like the CLI: the receipt travels with the head.

- ``load_with_heads`` resolves the checkpoint's receipt and returns it in ``info``;
- where it refuses, ``MTPDecoder``, ``mtp_stream_generate`` and ``MTPBatchGenerator``
  decode plainly and report the receipt's own typed reason and message (the CLI's
  ``"<reason>: <message>"``), with output identical to mlx-lm's;
- where it admits, they speculate. A receipt never says one thing while the decoder
  does another.
"""

from __future__ import annotations

import mlx.core as mx
import msgspec
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.generate import mtp_stream_generate
from melix_mlx.loading import load_with_heads

from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import resolution, resolve  # resolve reads the registry in resolution
from melix_fsm.registry import Support, registry

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
N = 10


def _decoders_follow(model, tokenizer, head, info) -> None:
    """Every decoder agrees with ``info.receipt``: refuse with its reason, or speculate."""
    want = reference(model, PROMPT, N)
    got, decoder = mtp(model, head, PROMPT, N, 2)
    assert got == want
    streamed = list(mtp_stream_generate(model, tokenizer, mx.array(PROMPT), head, N, num_draft_tokens=2))
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, max_tokens=N)
    if info.refusal is None:
        assert info.receipt.mode == "accepted"
        assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0
        assert gen.refusal is None
    else:
        reason = info.receipt.refusal_reason
        assert info.refusal == f"{reason.value}: {info.receipt.message}"
        assert decoder.stats["refusal"] == info.refusal and decoder.stats["cycles"] == 0
        assert streamed[-1].stats["refusal"] == info.refusal and streamed[-1].stats["cycles"] == 0
        assert gen.refusal == info.refusal
    gen.insert([PROMPT])
    out: list[int] = []
    while gen.batch.uids or gen._queue:
        out += [r.token for r in gen.next()[1]]
    assert out == want
    if info.refusal is not None:
        assert gen.speculative_stats()["cycles"] == 0


def test_receipt_comes_with_the_head(tiny_dirs):
    model, tokenizer, head, info = load_with_heads(tiny_dirs["mimo"])
    assert info.receipt is not None and info.receipt.mode == "accepted" and info.refusal is None
    assert info.receipt.family == "mimo" and info.receipt.head_count == info.head_layers == 1
    _decoders_follow(model, tokenizer, head, info)


def test_sliding_window_mimo_decoders_follow_the_receipt(tiny_checkpoint):
    """use_sliding_window, which mlx-lm's mimo model ignores: plain KV caches, speculated on."""
    path = tiny_checkpoint("mimo", use_sliding_window=True, sliding_window=6, max_window_layers=0)
    model, tokenizer, head, info = load_with_heads(path)
    assert [p.kind for p in info.receipt.caches] == ["kv"] and info.refusal is None
    assert head is not None  # decoding stays possible, speculating follows the receipt
    _decoders_follow(model, tokenizer, head, info)


def test_a_refusing_receipt_stops_speculation_with_its_reason(tiny_checkpoint, monkeypatch):
    """A family the receipt's registry refuses (the loader's still runs it): typed refusal end to end."""
    reg = registry()
    refused = msgspec.structs.replace(
        reg.families["glm4_moe"],
        support=Support.refused,
        refusal=RefusalReason.unsupported_model,
        message="glm4_moe refused for this test",
    )
    patched = msgspec.structs.replace(reg, families={**reg.families, "glm4_moe": refused})
    monkeypatch.setattr(resolution, "registry", lambda: patched)
    model, tokenizer, head, info = load_with_heads(tiny_checkpoint("glm4_moe"))
    assert info.receipt.refusal_reason is RefusalReason.unsupported_model
    assert info.refusal == "unsupported_model: glm4_moe refused for this test"
    _decoders_follow(model, tokenizer, head, info)


def test_families_without_a_head_module_are_refused_typed(tiny_dirs, tmp_path, monkeypatch):
    """A family the registry refuses (patched: every shipped family now runs) is refused
    typed by the receipt and by the loader, before any head is built."""
    import json
    import shutil

    from melix_mlx.loading import families as loading_families
    from melix_mlx.loading.errors import UnsupportedModel

    family = "mimo_v2_flash"
    reg = registry()
    refused = msgspec.structs.replace(
        reg.families[family],
        support=Support.refused,
        head_module=None,
        refusal=RefusalReason.unsupported_model,
        message=f"{family} refused for this test: no head module",
    )
    patched = msgspec.structs.replace(reg, families={**reg.families, family: refused})
    monkeypatch.setattr(resolution, "registry", lambda: patched)
    monkeypatch.setattr(loading_families, "registry", lambda: patched)
    path = shutil.copytree(tiny_dirs["deepseek_v3"], tmp_path / family)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": family}))
    receipt = resolve(path)
    assert receipt.mode == "refused" and receipt.refusal_reason is RefusalReason.unsupported_model
    with pytest.raises(UnsupportedModel, match=family):
        load_with_heads(path)
