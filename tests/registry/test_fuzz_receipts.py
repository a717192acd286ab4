"""Hypothesis fuzz: arbitrary config dicts, weight maps and header bytes give only typed outcomes.

Invariants checked on every example: `resolve` returns a `Receipt` (nothing escapes), the
receipt round-trips through its JSON, accepted <=> no refusal reason <=> lifecycle state
admitted, a refused or legacy start resolves to method none, and an accepted MTP start had
its head weights present.
"""

from __future__ import annotations

import copy
import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import event, given
from hypothesis import strategies as st

from melix_fsm.config import Method, SpeculativeConfig
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import Mode, Receipt, ServingContext, receipt_json, resolve
from melix_fsm.registry import registry

from .conftest import FAMILY_KEYS, write_safetensors, write_tokenizer

MODEL_TYPES = sorted(registry().model_types) + ["gpt2", "qwen3_5_mtp", ""]
HEAD_KEYS = sorted({k for _, main, head in FAMILY_KEYS.values() for k in main + head})

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
counts = st.one_of(st.integers(min_value=-2, max_value=4), json_values)

text_config = st.fixed_dictionaries(
    {},
    optional={
        "model_type": st.sampled_from(MODEL_TYPES) | json_values,
        "mtp_num_hidden_layers": counts,
        "num_hidden_layers": counts,
        "vocab_size": st.integers(min_value=-1, max_value=64) | json_values,
        "layer_types": st.lists(st.sampled_from(["full_attention", "linear_attention", "sliding_attention"])),
    },
)
configs = st.fixed_dictionaries(
    {},
    optional={
        "model_type": st.sampled_from(MODEL_TYPES) | json_values,
        "num_nextn_predict_layers": counts,
        "num_hidden_layers": counts,
        "vocab_size": st.integers(min_value=-1, max_value=64) | json_values,
        "text_config": text_config | json_values,
        "use_sliding_window": st.booleans(),
        "sliding_window": st.integers(min_value=1, max_value=4096) | st.none(),
        "quantization": st.just({"bits": 4, "group_size": 64}),
        "architectures": st.lists(st.sampled_from(["X", "Qwen3_5MTPModel", "LlamaForCausalLM"]), max_size=2),
    },
)

# A converted checkpoint's record, rarely (it names a file that usually does not exist).
melix = st.sampled_from([None] * 6 + [{"file": "mtp.safetensors"}, {"file": "../x"}, {"file": 3}, {}])
key_lists = st.lists(st.sampled_from(HEAD_KEYS) | st.text(min_size=1, max_size=12), max_size=12, unique=True)
weight_maps = st.lists(key_lists, min_size=0, max_size=3)  # one list per shard


@st.composite
def plausible(draw: st.DrawFn) -> tuple[dict, list[list[str]]]:
    """A real family's config and keys with a few settings overridden and keys dropped."""
    family = draw(st.sampled_from(sorted(FAMILY_KEYS)))
    base, main, head = FAMILY_KEYS[family]
    config = copy.deepcopy(base)
    overrides = draw(configs)
    for key in draw(st.lists(st.sampled_from(sorted(overrides)), unique=True)) if overrides else []:
        config[key] = overrides[key]
    keys = [k for k in main + head if draw(st.integers(0, 9))]  # drop about one key in ten
    split = draw(st.integers(0, len(keys)))
    shards = [keys[:split], keys[split:]] if draw(st.booleans()) else [keys]
    return config, shards


cases = st.one_of(plausible(), st.tuples(configs, weight_maps))
header_bytes = st.one_of(
    st.binary(max_size=32),
    st.builds(lambda n, b: struct.pack("<Q", n) + b, st.integers(0, 2**64 - 1), st.binary(max_size=24)),
)
speculative = st.builds(
    SpeculativeConfig,
    method=st.sampled_from([Method.mtp, Method.mtp, Method.none]),
    num_draft_tokens=st.integers(1, 16),
    device_policy=st.sampled_from(["auto", "force_on", "force_off"]),
)
contexts = st.builds(ServingContext, quantized_kv=st.booleans(), chunked_prefill=st.booleans())


def _check(receipt: Any, config: SpeculativeConfig) -> None:
    assert isinstance(receipt, Receipt)
    event(f"{receipt.mode.value}: {receipt.refusal_reason}")
    assert receipt.refusal_reason is None or isinstance(receipt.refusal_reason, RefusalReason)
    assert msgspec.json.decode(receipt_json(receipt), type=Receipt) == receipt
    accepted = receipt.mode is Mode.accepted
    assert accepted == (receipt.refusal_reason is None) == (receipt.lifecycle_state == "admitted")
    if not accepted:
        assert receipt.resolved_method is Method.none and receipt.effective_depth == 0
    elif config.method is Method.mtp:
        assert receipt.weights_present and receipt.head_count >= 1
    if receipt.mode is Mode.legacy_only:
        assert receipt.refusal_reason is RefusalReason.operator_disabled


@given(case=cases, melix_record=melix, spec=speculative, context=contexts, index=st.booleans())
def test_config_and_weight_map_fuzz(
    case: tuple[dict, list[list[str]]],
    melix_record: dict | None,
    spec: SpeculativeConfig,
    context: ServingContext,
    index: bool,
) -> None:
    config, shards = case
    if melix_record is not None:
        config = {**config, "melix_mtp": melix_record}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "config.json").write_text(json.dumps(config))
        weight_map = {}
        for i, keys in enumerate(shards):
            name = (
                f"model-{i:05d}.safetensors"
                if i
                else "mtp.safetensors"
                if len(shards) > 2
                else "model.safetensors"
            )
            write_safetensors(root / name, keys)
            weight_map.update(dict.fromkeys(keys, name))
        if index:
            (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        write_tokenizer(root)
        _check(resolve(root, spec, context=context), spec)


@given(config_raw=st.binary(max_size=64) | configs.map(lambda c: json.dumps(c).encode()), header=header_bytes)
def test_raw_bytes_fuzz(config_raw: bytes, header: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "config.json").write_bytes(config_raw)
        (root / "model.safetensors").write_bytes(header)
        spec = SpeculativeConfig()
        _check(resolve(root, spec), spec)


@given(target=plausible() | configs.map(lambda c: (c, [])), draft=plausible(), same_tokenizer=st.booleans())
def test_draft_model_fuzz(target: tuple, draft: tuple, same_tokenizer: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for name, (cfg, _) in (("t", target), ("d", draft)):
            path = Path(tmp) / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(cfg))
            write_safetensors(path / "model.safetensors", ["model.embed_tokens.weight"])
            dirs.append(path)
        write_tokenizer(dirs[0])
        write_tokenizer(dirs[1], None if same_tokenizer else {"z": 0})
        spec = SpeculativeConfig(method=Method.draft_model, draft_model=str(dirs[1]))
        _check(resolve(dirs[0], spec), spec)
