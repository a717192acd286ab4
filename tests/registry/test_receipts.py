"""Receipts per family and layout: admitted, refused with the right typed reason, never raised."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from melix_fsm.checkpoint import read_checkpoint
from melix_fsm.config import Method, speculative_config
from melix_fsm.errors import IllegalTransition
from melix_fsm.lifecycle import SequenceMachine, State
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import BatchShape, HardwareGate, Mode, Receipt, ServingContext, receipt_json, resolve

from .conftest import Fakes, write_safetensors, write_tokenizer
from .test_registry_spec import REFUSED

OWN_LAYOUT = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "mimo"]


@pytest.mark.parametrize("layout", ["single", "sharded", "sidecar"])
@pytest.mark.parametrize("family", OWN_LAYOUT)
def test_own_layout_families_are_admitted(fakes: Fakes, family: str, layout: str) -> None:
    path = fakes.make(family, layout=layout)
    machine = SequenceMachine("row")
    r = resolve(path, machine=machine)
    assert r.mode is Mode.accepted, r.message
    assert r.refusal_reason is None and r.resolved_method is Method.mtp
    assert machine.state is State("admitted") and r.lifecycle_state == "admitted"
    assert r.family == family and r.head_module == family
    assert r.weights_present and r.weight_count > 0 and r.head_count == 1 and r.effective_depth == 1
    assert all(c > 0 for c in r.layer_weight_counts)
    assert r.hardware_gate is HardwareGate.not_evaluated and r.hardware is None
    assert r.batch_shape is BatchShape.batched
    if layout == "sidecar":
        assert r.head_files == ["mtp.safetensors"]  # outside mlx-lm's model*.safetensors glob


def test_family_facts_come_from_the_registry(fakes: Fakes) -> None:
    qwen = resolve(fakes.make("qwen3_5"))
    assert qwen.concat == "embedding_first" and qwen.norm_repair == "plus_one" and qwen.chain == "post_norm"
    assert [(c.kind, c.strategy) for c in qwen.caches] == [
        ("kv", "trim"),
        ("arrays", "capture_select"),
    ]
    mimo = resolve(fakes.make("mimo"))
    assert mimo.concat == "hidden_first" and mimo.norm_repair == "none"
    ds = resolve(fakes.make("deepseek_v3"))
    assert ds.chain == "pre_norm" and [c.kind for c in ds.caches] == ["kv"]


@pytest.mark.parametrize("layout", ["single", "sharded", "sidecar"])
@pytest.mark.parametrize("family", OWN_LAYOUT)
def test_mlx_community_conversion_without_heads_is_refused(fakes: Fakes, family: str, layout: str) -> None:
    path = fakes.make(family, layout=layout, head=False)
    if layout == "sharded":  # the conversion keeps one shard only
        path = fakes.make(family, layout="single", head=False)
    r = resolve(path)
    assert r.refusal_reason is RefusalReason.missing_head_weights, r.message
    assert not r.weights_present and r.weight_count == 0 and r.missing_weights
    assert r.lifecycle_state == "refused"


def test_partially_missing_head_names_the_missing_prefix(fakes: Fakes) -> None:
    path = fakes.make("deepseek_v3")
    write_safetensors(
        path / "model.safetensors", ["model.embed_tokens.weight", "model.layers.3.enorm.weight"]
    )
    r = resolve(path)
    assert r.refusal_reason is RefusalReason.missing_head_weights
    assert "model.layers.3.hnorm." in r.missing_weights and r.weight_count == 1


def test_melix_converted_head_counts_as_present(fakes: Fakes) -> None:
    path = fakes.make("qwen3_5", head=False, update={"melix_mtp": {"file": "head.safetensors", "format": 1}})
    write_safetensors(path / "head.safetensors", ["melix_mtp.fc.weight", "melix_mtp.layers.0.q.weight"])
    r = resolve(path)
    assert r.mode is Mode.accepted and r.head_format == "melix" and r.head_files == ["head.safetensors"]
    assert r.weight_count == 2


def test_melix_entry_naming_a_missing_file_is_unreadable(fakes: Fakes) -> None:
    path = fakes.make("qwen3_5", head=False, update={"melix_mtp": {"file": "gone.safetensors"}})
    r = resolve(path)
    assert r.refusal_reason is RefusalReason.unreadable_checkpoint and "gone.safetensors" in r.message


@pytest.mark.parametrize("family", sorted(REFUSED))  # the refused families the spec test pins
def test_design_families_we_do_not_run_are_refused_by_name(fakes: Fakes, family: str) -> None:
    path = fakes.make(
        "llama", config={"model_type": family, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}
    )
    r = resolve(path)
    assert r.refusal_reason is RefusalReason.unsupported_model and r.family == family
    assert family in r.message and "not in the family registry" not in r.message


def test_model_without_mtp_is_refused_with_a_distinct_message(fakes: Fakes) -> None:
    r = resolve(fakes.make("llama"))
    assert r.refusal_reason is RefusalReason.unsupported_model and r.family == "llama"
    assert "no native MTP head" in r.message


def test_unknown_model_type_is_refused_as_unsupported(fakes: Fakes) -> None:
    r = resolve(fakes.make("llama", config={"model_type": "gpt2"}))
    assert r.refusal_reason is RefusalReason.unsupported_model and r.family is None
    assert "not in the family registry" in r.message


@pytest.mark.parametrize(
    "value,reason",
    [
        (-1, RefusalReason.invalid_config),
        ("1", RefusalReason.invalid_config),
        (True, RefusalReason.invalid_config),
        (1.0, RefusalReason.invalid_config),
        (10**9, RefusalReason.invalid_config),
        (0, RefusalReason.unsupported_model),
        (None, RefusalReason.unsupported_model),
    ],
)
def test_head_count_values(fakes: Fakes, value: object, reason: RefusalReason) -> None:
    r = resolve(fakes.make("mimo", update={"num_nextn_predict_layers": value}))
    assert r.refusal_reason is reason, r.message


def test_head_count_nested_under_text_config(fakes: Fakes) -> None:
    config = json.loads(json.dumps(fakes_config("qwen3_5")))
    config["text_config"]["mtp_num_hidden_layers"] = -3
    r = resolve(fakes.make("qwen3_5", config=config))
    assert (
        r.refusal_reason is RefusalReason.invalid_config and "text_config.mtp_num_hidden_layers" in r.message
    )


def fakes_config(family: str) -> dict:
    from .conftest import FAMILY_KEYS

    return FAMILY_KEYS[family][0]


def test_layer_count_needed_by_deepseek_layout(fakes: Fakes) -> None:
    r = resolve(fakes.make("deepseek_v3", update={"num_hidden_layers": "three"}))
    assert r.refusal_reason is RefusalReason.invalid_config and "num_hidden_layers" in r.message


def test_two_advertised_heads_with_one_present(fakes: Fakes) -> None:
    r = resolve(fakes.make("mimo", update={"num_nextn_predict_layers": 2}))
    assert r.refusal_reason is RefusalReason.missing_head_weights
    assert r.layer_weight_counts == [5, 0] and r.missing_weights == ["model.mtp_layers.1."]


def test_auto_depth_resolves_to_a_bounded_range(fakes: Fakes) -> None:
    from melix_fsm.policy.depth import AUTO_MAX_DEPTH

    r = resolve(fakes.make("mimo"), speculative_config(num_draft_tokens="auto"))
    assert r.mode is Mode.accepted and r.num_draft_tokens == "auto"
    assert r.effective_depth == AUTO_MAX_DEPTH and "depth auto (1..4" in r.message
    assert r.depth is None  # the starting depth is chosen once the model is measured
    assert b'"num_draft_tokens": "auto"' in receipt_json(r)


def test_depth_beyond_heads_is_admitted_for_chaining_families(fakes: Fakes) -> None:
    r = resolve(fakes.make("mimo"), speculative_config(num_draft_tokens=3))
    assert r.mode is Mode.accepted and r.effective_depth == 3 and r.head_count == 1


def test_sliding_layers_run_single_and_batched_unquantized(fakes: Fakes) -> None:
    """A llama whose layer_types mark sliding layers: mlx-lm windows them (rotating cache)."""
    swa = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512}
    target, draft = fakes.make("llama", update=swa), fakes.make("llama")
    config = speculative_config(method="draft_model", draft_model=str(draft))
    for context in (ServingContext(), ServingContext(batched=True)):
        r = resolve(target, config, context=context)
        assert r.mode is Mode.accepted
        assert [(p.kind, p.strategy) for p in r.caches] == [("kv", "trim"), ("rotating", "window_spare")]
    r = resolve(target, config, context=ServingContext(quantized_kv=True, chunked_prefill=True))
    assert r.refusal_reason is RefusalReason.unsupported_quantization and "rotating" in r.message


@pytest.mark.parametrize(
    "update",
    [
        {"use_sliding_window": True, "sliding_window": 512},
        {"layer_types": ["sliding_attention"], "sliding_window": 512},
    ],
)
def test_window_keys_an_mlx_lm_model_ignores_add_no_window(fakes: Fakes, update: dict) -> None:
    """mlx-lm's mimo (qwen2) model reads neither key: plain KVCache, so batches are admitted."""
    path = fakes.make("mimo", update=update)
    r = resolve(path, context=ServingContext(batched=True))
    assert r.mode is Mode.accepted and [p.kind for p in r.caches] == ["kv"]


@pytest.mark.parametrize(
    "update",
    [
        {"model_type": "qwen3_5_mtp"},
        {"architectures": ["Qwen3_5MTPForCausalLM"]},
        {"num_hidden_layers": 0},
        {"draft_vocab_size": 32000},
    ],
)
def test_sidecar_shaped_model_is_refused_before_load(fakes: Fakes, update: dict) -> None:
    r = resolve(fakes.make("mimo", update=update))
    assert r.refusal_reason is RefusalReason.unvalidated_sidecar, r.message


def test_head_only_checkpoint_is_a_sidecar(fakes: Fakes) -> None:
    path = fakes.make("mimo")
    write_safetensors(path / "model.safetensors", fakes_heads("mimo"))
    r = resolve(path)
    assert r.refusal_reason is RefusalReason.unvalidated_sidecar


def fakes_heads(family: str) -> list[str]:
    from .conftest import FAMILY_KEYS

    return FAMILY_KEYS[family][2]


@pytest.mark.parametrize("method,policy", [("none", None), ("mtp", "force_off")])
def test_operator_disabled_is_legacy_only_and_still_reports(
    fakes: Fakes, method: str, policy: str | None
) -> None:
    r = resolve(fakes.make("mimo", head=False), speculative_config(method=method, device_policy=policy))
    assert r.mode is Mode.legacy_only and r.refusal_reason is RefusalReason.operator_disabled
    assert r.resolved_method is Method.none and r.lifecycle_state == "refused" and r.effective_depth == 0
    assert "missing_head_weights" in r.message  # the capability finding is not hidden
    assert r.operator_override == (policy is not None)


def test_force_on_is_recorded_as_an_override(fakes: Fakes) -> None:
    r = resolve(fakes.make("mimo"), speculative_config(device_policy="force_on"))
    assert r.mode is Mode.accepted and r.operator_override and r.hardware_gate is HardwareGate.not_evaluated


def test_resolution_requires_a_requested_machine(fakes: Fakes) -> None:
    machine = SequenceMachine("row")
    resolve(fakes.make("mimo"), machine=machine)
    with pytest.raises(IllegalTransition):
        resolve(fakes.make("mimo"), machine=machine)
    assert machine.state is State("admitted")


# -- draft_model -------------------------------------------------------------------------


def _draft_cfg(fakes: Fakes, **kw: object) -> tuple[Path, Path]:
    target = fakes.make("llama")
    draft = fakes.make("llama", **kw)  # type: ignore[arg-type]
    return target, draft


def test_draft_model_with_shared_vocab_is_admitted(fakes: Fakes) -> None:
    target, draft = _draft_cfg(fakes)
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft), num_draft_tokens=3))
    assert r.mode is Mode.accepted and r.resolved_method is Method.draft_model
    assert r.draft_family == "llama" and r.effective_depth == 3 and r.batch_shape is BatchShape.batched


def test_draft_model_padding_only_vocab_difference_is_admitted(fakes: Fakes) -> None:
    target, draft = _draft_cfg(fakes, update={"vocab_size": 64})
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.mode is Mode.accepted and (r.vocab_size, r.draft_vocab_size) == (27, 64)


def test_draft_model_config_vocab_too_small_is_vocab_mismatch(fakes: Fakes) -> None:
    target, draft = _draft_cfg(fakes, update={"vocab_size": 5})
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.refusal_reason is RefusalReason.vocab_mismatch


def test_draft_model_with_other_tokenizer_is_vocab_mismatch(fakes: Fakes) -> None:
    target, draft = _draft_cfg(fakes)
    write_tokenizer(draft, {chr(65 + i): i for i in range(26)})
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.refusal_reason is RefusalReason.vocab_mismatch and "tokenizers differ" in r.message


def test_draft_model_without_tokenizer_cannot_prove_vocab(fakes: Fakes) -> None:
    target, draft = _draft_cfg(fakes, tokenizer=False)
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.refusal_reason is RefusalReason.vocab_mismatch


def test_sentencepiece_only_tokenizers_compare_by_hash(fakes: Fakes) -> None:
    target, draft = _draft_cfg(fakes, tokenizer=False)
    (target / "tokenizer.json").unlink()
    (target / "tokenizer.model").write_bytes(b"spm-a")
    (draft / "tokenizer.model").write_bytes(b"spm-a")
    cfg = speculative_config(method="draft_model", draft_model=str(draft))
    assert resolve(target, cfg).mode is Mode.accepted
    (draft / "tokenizer.model").write_bytes(b"spm-b")
    assert resolve(target, cfg).refusal_reason is RefusalReason.vocab_mismatch


def test_assistant_sidecar_as_draft_is_refused(fakes: Fakes) -> None:
    target = fakes.make("qwen3_5")
    draft = fakes.make("llama", config={"model_type": "qwen3_5_mtp", "num_hidden_layers": 1})
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(draft)))
    assert r.refusal_reason is RefusalReason.unvalidated_sidecar and "draft model" in r.message


def test_unreadable_draft_model_is_unreadable(fakes: Fakes, tmp_path: Path) -> None:
    target = fakes.make("llama")
    r = resolve(target, speculative_config(method="draft_model", draft_model=str(tmp_path / "nope")))
    assert r.refusal_reason is RefusalReason.unreadable_checkpoint and "draft model" in r.message


def test_receipt_round_trips_through_its_json(fakes: Fakes) -> None:
    r = resolve(fakes.make("qwen3_5", layout="sharded"))
    again = msgspec.json.decode(receipt_json(r), type=Receipt)
    assert again == r and receipt_json(again) == receipt_json(r)


def test_detection_reads_no_tensor_data(fakes: Fakes) -> None:
    # Data bytes that are not floats at all: detection must not care.
    path = fakes.make("mimo")
    raw = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(raw[:-4] + b"\xff\xfe\xfd\xfc")
    assert resolve(path).mode is Mode.accepted
    assert read_checkpoint(path).files == ("model.safetensors",)
