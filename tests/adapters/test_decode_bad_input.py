"""Bad checkpoints are refused with a typed reason before any decoding.

Variants of a tiny mimo checkpoint: a head tensor with a corrupted shape, one head
tensor missing, every head tensor missing, and the head of a model with another hidden
size. Each is refused by `load_with_heads` (a typed HeadLoadError) and by
`melix-fsm generate --method mtp` (exit 3, a JSON object naming the reason, nothing
decoded: the receipt refuses missing tensors from the headers, the loader refuses
shapes). Without an explicit `--method`, the same checkpoints decode plainly and the
refusal is recorded in the JSON result and on stderr.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from melix_mlx.loading import load_with_heads
from melix_mlx.loading.errors import HeadLoadError, HeadShapeMismatch, MissingHeadWeights

from melix_fsm.cli import main

HEAD = "model.mtp_layers.0."


def _shape(w: dict, other: dict) -> None:
    w[HEAD + "input_proj.weight"] = mx.zeros((64, 100))


def _missing_one(w: dict, other: dict) -> None:
    del w[HEAD + "final_layernorm.weight"]


def _missing_all(w: dict, other: dict) -> None:
    for key in [k for k in w if k.startswith(HEAD)]:
        del w[key]


def _other_model(w: dict, other: dict) -> None:
    _missing_all(w, other)
    w.update({k: v for k, v in other.items() if k.startswith(HEAD)})


CASES: dict[str, tuple[Callable[[dict, dict], None], type[HeadLoadError], str]] = {
    "corrupt_shape": (_shape, HeadShapeMismatch, "head_shape_mismatch"),
    "missing_one": (_missing_one, MissingHeadWeights, "missing_head_weights"),
    "missing_all": (_missing_all, MissingHeadWeights, "missing_head_weights"),
    "other_hidden_size": (_other_model, HeadShapeMismatch, "head_shape_mismatch"),
}


@pytest.fixture(scope="module")
def bad_dirs(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    base = tiny_checkpoint("mimo")
    other = mx.load(str(tiny_checkpoint("mimo", hidden_size=32, intermediate_size=64) / "model.safetensors"))
    root = tmp_path_factory.mktemp("bad")
    out = {}
    for name, (edit, _, _) in CASES.items():
        target = root / name
        shutil.copytree(base, target)
        weights = mx.load(str(target / "model.safetensors"))
        edit(weights, other)
        mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "pt"})
        out[name] = target
    return out


@pytest.mark.parametrize("case", CASES)
def test_load_with_heads_refuses(bad_dirs, case: str) -> None:
    _, error, reason = CASES[case]
    with pytest.raises(error) as info:
        load_with_heads(bad_dirs[case])
    assert info.value.reason == reason


@pytest.mark.parametrize("case", CASES)
def test_generate_explicit_mtp_exits_3(bad_dirs, case: str, capsys) -> None:
    reason = CASES[case][2]
    argv = ["generate", "--model", str(bad_dirs[case]), "--prompt", "x", "--method", "mtp", "--json"]
    assert main(argv) == 3
    out = capsys.readouterr()
    [result] = [json.loads(line) for line in out.out.splitlines()]
    assert result["error"] == reason
    assert "receipt" in result and "tokens" not in result  # refused before decoding
    assert reason in out.err


@pytest.mark.parametrize("case", ["corrupt_shape", "missing_all"])
def test_generate_default_method_decodes_plainly_and_records(bad_dirs, tiny_checkpoint, case, capsys) -> None:
    reason = CASES[case][2]
    argv = ["generate", "--model", str(bad_dirs[case]), "--prompt", "x", "--json", "--max-tokens", "6"]
    assert main(argv) == 0
    out = capsys.readouterr()
    [result] = [json.loads(line) for line in out.out.splitlines()]
    assert result["method"] == "none" and len(result["tokens"]) == 6
    assert result["stats"]["cycles"] == 0 and reason in result["stats"]["refusal"]
    assert result["stats"]["state"] == "refused"  # late refusal on the receipt's own machine
    recorded = result["receipt"]["refusal_reason"] or result["head_load_error"]["reason"]
    assert recorded == reason
    assert "decoding plainly" in out.err
    # plain decode of the same main weights: the intact checkpoint's tokens
    argv = [
        "generate",
        "--model",
        str(tiny_checkpoint("mimo")),
        "--prompt",
        "x",
        "--json",
        "--max-tokens",
        "6",
    ]
    assert main([*argv, "--method", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == result["tokens"]


def test_late_refusal_is_the_specs_transition(loaded_heads) -> None:
    """A receipt admitted the row; the loaded decoder refuses (a sampler whose distribution
    it cannot verify): the machine takes the spec's `refuse` from `admitted`, for good, and
    the row decodes plainly with the caller's sampler."""
    from decode_refs import reference
    from melix_mlx.decode import MTPDecoder

    from melix_fsm.lifecycle import ADMIT, SequenceMachine, State

    model, _, head, _ = loaded_heads["deepseek_v3"]
    machine = SequenceMachine(0)
    machine.send(ADMIT)  # what the receipt does before any weight is read

    def opaque_greedy(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    prompt = [3, 141, 59, 26]
    decoder = MTPDecoder(model, head, num_draft_tokens=2, sampler=opaque_greedy, machine=machine)
    tokens = [t for t, _, _ in decoder.generate(mx.array(prompt), 8)]
    assert tokens == reference(model, prompt, 8, sampler=opaque_greedy)
    stats = decoder.stats
    assert stats["state"] == State.refused and "unknown sampler" in stats["refusal"]
    # the first token comes from the prefill, the other 7 from plain steps
    assert stats["cycles"] == 0 and stats["plain_steps"] == 7 and stats["suspensions"] == 0


@pytest.mark.parametrize("prompt", [[], [3, 10**6], [-1, 4]])
def test_prompts_the_model_cannot_read_are_refused_before_any_forward(loaded_heads, prompt) -> None:
    """Unknown token ids would read past the embedding table (garbage or a crash): both
    decoders refuse them, typed, and the batch generator queues nothing."""
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.decode import MTPDecoder
    from melix_mlx.loading.errors import InvalidPrompt

    model, _, head, _ = loaded_heads["mimo"]
    decoder = MTPDecoder(model, head)
    with pytest.raises(InvalidPrompt):
        next(decoder.generate(mx.array(prompt, dtype=mx.int32), 4))
    assert decoder.cache[0].offset == 0  # nothing was fed
    generator = MTPBatchGenerator(model, head)
    with pytest.raises(InvalidPrompt):
        generator.insert([[3, 4, 5], prompt], max_tokens=[4, 4])
    assert generator.insert([[3, 4, 5]], max_tokens=[2]) == [0]  # the good one was not queued before
    generator.close()
