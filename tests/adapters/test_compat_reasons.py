"""Every RefusalReason in the enum is produced by a concrete input (none is dead vocabulary).

Receipt-time reasons come from checkpoint directories and settings (no weights read);
runtime ones from the loaded decoder or loader. Two former reasons are gone because no
input could produce them: `depth_exceeds_heads` (every runnable head chains, so any depth
is admitted) and `unvalidated_family` (no family borrows another's head layout; each has
its own head module under greedy-identity tests). spec/families.toml no longer has the
keys that would need them (`chain = "none"`, `layout_of`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from compat_models import make_llama, make_sidecar
from melix_mlx.loading.checkpoints import resolve_model

from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason, reason_of
from melix_fsm.receipt import ServingContext, resolve

QUANTIZED = ServingContext(quantized_kv=True)
BATCHED = ServingContext(batched=True)
NEGATIVE_HEADS = {"num_nextn_predict_layers": -1}


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _tiny() -> Path:
    return resolve_model("stdlib-tiny")


def _receipt(path: Path, context: ServingContext | None = None, **settings) -> RefusalReason | None:
    return resolve(path, speculative_config(**settings), context=context).refusal_reason


def _missing_head(tmp: Path) -> RefusalReason | None:
    path = _copy(_tiny(), tmp / "no-head")  # as an mlx-lm conversion leaves it: head tensors dropped
    (path / "mtp.safetensors").unlink()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != "mtp.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return _receipt(path)


def _head_shape(tmp: Path) -> RefusalReason | None:
    from melix_mlx.loading import load_with_heads
    from melix_mlx.loading.errors import HeadLoadError

    path = _copy(_tiny(), tmp / "bad-shape")
    tensors = mx.load(str(path / "mtp.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith("eh_proj.weight"))
    tensors[key] = tensors[key][:, :-1]
    mx.save_safetensors(str(path / "mtp.safetensors"), tensors, metadata={"format": "pt"})
    with pytest.raises(HeadLoadError) as err:
        load_with_heads(path)
    return err.value.reason


def _device_policy(tmp: Path, monkeypatch) -> RefusalReason | None:
    from melix_mlx.decoding import activation
    from melix_mlx.loading import load_with_heads

    from melix_fsm.policy.errors import CalibrationError

    monkeypatch.setattr(activation, "calibrate", lambda *a, **kw: CalibrationError("measurement_failed", "x"))
    model, _, head, _ = load_with_heads(_tiny())
    config = speculative_config()
    return activation.evaluate(model, head, resolve(_tiny(), config), config).receipt.refusal_reason


def _own_sampler(logprobs: mx.array) -> mx.array:
    """A caller's sampler the decoder cannot read a distribution from."""
    return mx.argmax(logprobs, axis=-1)


def _decoder_refusal(**kw) -> RefusalReason | None:
    from melix_mlx.decode import MTPDecoder
    from melix_mlx.loading import load_with_heads

    model, _, head, _ = load_with_heads(_tiny())
    decoder = MTPDecoder(model, head, **kw)
    list(decoder.generate(mx.array([5, 6, 7]), 2))
    return reason_of(decoder.stats["refusal"])


def _windowed_draft(tmp: Path) -> RefusalReason | None:
    """A draft model whose layer_types window a layer (mlx-lm's llama): in the head slot
    only trimmable KV caches roll back (a windowed target batches: test_batched_windows.py)."""
    layers = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    target, draft = make_llama(tmp / "target"), make_llama(tmp / "swa", seed=2, **layers)
    return _receipt(target, BATCHED, method="draft_model", draft_model=str(draft))


class _TwoRanks:
    """A 2-rank group stand-in: the refusal comes before any collective or weight."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def _sharding(tmp: Path) -> RefusalReason | None:
    from melix_mlx.runtime.distributed import ShardingRefused, load_sharded

    with pytest.raises(ShardingRefused) as err:  # 3 attention heads over 2 ranks
        load_sharded(_tiny(), "tensor", _TwoRanks())
    return RefusalReason(err.value.reason)


def _vocab(tmp: Path) -> RefusalReason | None:
    draft = make_llama(tmp / "draft")
    data = json.loads((draft / "tokenizer.json").read_text())
    data["model"]["vocab"]["zzz-extra"] = 5000
    (draft / "tokenizer.json").write_text(json.dumps(data))
    return _receipt(_tiny(), method="draft_model", draft_model=str(draft))


CASES: dict[RefusalReason, Callable[..., RefusalReason | None]] = {
    RefusalReason.missing_head_weights: lambda tmp, mp: _missing_head(tmp),
    RefusalReason.head_shape_mismatch: lambda tmp, mp: _head_shape(tmp),
    RefusalReason.unsupported_model: lambda tmp, mp: _receipt(make_llama(tmp / "llama")),
    RefusalReason.unvalidated_sidecar: lambda tmp, mp: _receipt(make_sidecar(_tiny(), tmp / "sidecar")),
    RefusalReason.unsupported_cache_sharing: lambda tmp, mp: _windowed_draft(tmp),
    RefusalReason.unsupported_quantization: lambda tmp, mp: _receipt(_tiny(), QUANTIZED),
    RefusalReason.device_policy_disabled: _device_policy,
    RefusalReason.invalid_config: lambda tmp, mp: _receipt(_copy(_tiny(), tmp / "b", **NEGATIVE_HEADS)),
    RefusalReason.vocab_mismatch: lambda tmp, mp: _vocab(tmp),
    RefusalReason.operator_disabled: lambda tmp, mp: _receipt(_tiny(), method="none"),
    RefusalReason.unreadable_checkpoint: lambda tmp, mp: _receipt(tmp / "does-not-exist"),
    RefusalReason.unsupported_sharding: lambda tmp, mp: _sharding(tmp),
    RefusalReason.unsupported_sampler: lambda tmp, mp: _decoder_refusal(sampler=_own_sampler),
}


def test_every_reason_has_a_case() -> None:
    assert set(CASES) == set(RefusalReason)


@pytest.mark.parametrize("reason", list(RefusalReason), ids=str)
def test_reason_is_produced(reason: RefusalReason, tmp_path: Path, monkeypatch) -> None:
    assert CASES[reason](tmp_path, monkeypatch) is reason


def test_runtime_cache_refusal_is_typed() -> None:
    """A rotating cache (max_kv_size) in a batch, found by the generator: the spec's typed reason."""
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.loading import load_with_heads

    model, _, head, _ = load_with_heads(_tiny())
    gen = MTPBatchGenerator(model, head, max_kv_size=64)
    assert reason_of(gen.refusal) is RefusalReason.unsupported_cache_sharing and "rotating" in gen.refusal
    gen.close()
