"""The mlx-vlm adapter (extra ``vlm``): a Qwen3.5 VL checkpoint with images in the prompt,
prefilled by mlx-vlm, decoded by the cycle engine with its MTP head.

The checkpoint is the embedded ``stdlib-hybrid`` wrapped with a tiny vision tower in the
upstream layout (``melix_mlx.vlm.tiny``), dense (``qwen3_5``) and as its MoE variant
(``qwen3_5_moe``, the 35B-A3B layout); 64 x 64 images give 4 image tokens, so the
multimodal positions really differ from text positions (a rope delta of -2).
- mlx-vlm loads either with its tower; the head comes through the registry, the receipt
  admits it and the tower is noted;
- greedy MTP decoding equals mlx-vlm's own greedy ``generate_step`` token for token, with
  an image (two images, two different outputs) and without, at k = 1..3 (the MoE variant
  at k = 2), with rejections;
- a head-less VL conversion takes its head from a split-drafter pack through the contract;
- two rows on a single-row cache are a typed refusal (batched rows: test_vlm_batch.py);
- ``make-tiny FAMILY --vision`` writes either checkpoint (the MoE one's head is what mlx-vlm's
  own ``split_mtp`` reads from it, tensor for tensor); any other family is a usage error.
Skipped when mlx-vlm is not installed (``pip install 'melix-fsm[vlm]'``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL.Image")

from melix_mlx.loading.errors import UnsupportedServing  # noqa: E402
from melix_mlx.loading.head_pack import write_pack  # noqa: E402
from melix_mlx.vlm import generate, load_vlm, prepare, reference  # noqa: E402
from melix_mlx.vlm.tiny import FAMILIES  # noqa: E402
from vlm_helpers import IMAGE_PROMPT, image, loaded_vl, tiny_vl  # noqa: E402  (tests/adapters is on sys.path)

from melix_fsm.reasons import RefusalReason  # noqa: E402

N = 20
CASES = [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5", 3), ("qwen3_5_moe", 2)]  # (family, k)


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_vl()


@pytest.fixture(scope="module")
def loaded():
    return loaded_vl()


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_with_its_tower_and_head(family):
    model, processor, head, info = loaded_vl(family)
    assert info.receipt.mode == "accepted" and info.refusal is None, info.receipt.message
    assert head is not None and info.head_layers == 1 and info.family == family
    assert info.receipt.head_module == family
    assert info.vision_tower is not None and info.vision_tower.startswith(f"{family}: depth 1")
    inputs = prepare(model, processor, IMAGE_PROMPT, [image(0)])
    assert inputs["input_ids"][0].tolist().count(processor.image_token_id) == 4
    grid = inputs["image_grid_thw"]
    prompt = model.features(inputs["input_ids"], inputs["pixel_values"], image_grid_thw=grid)
    assert prompt.delta == -2  # multimodal positions, not text positions


@pytest.mark.parametrize(("family", "k"), CASES)
def test_image_prompt_is_mlx_vlms_greedy(family, k):
    model, processor, head, _ = loaded_vl(family)
    outputs = []
    for seed in (0, 1):
        inputs = prepare(model, processor, IMAGE_PROMPT, [image(seed)])
        want = reference(model, inputs, N)
        tokens, decoder = generate(model, head, inputs, N, num_draft_tokens=k)
        got = [t for t, _, _ in tokens]
        assert got == want
        assert decoder.stats["refusal"] is None and decoder.stats["accepted"] > 0
        assert decoder.stats["rollbacks"] > 0  # rejections rolled back through the captured states
        outputs.append(got)
    assert outputs[0] != outputs[1]  # the image reaches the language model


def test_text_prompt_is_mlx_vlms_greedy(loaded):
    model, processor, head, _ = loaded
    inputs = prepare(model, processor, "def main(): w")
    tokens, decoder = generate(model, head, inputs, N, num_draft_tokens=2)
    assert [t for t, _, _ in tokens] == reference(model, inputs, N) and decoder.stats["accepted"] > 0


def test_head_from_a_pack(tiny, tmp_path):
    target = shutil.copytree(tiny, tmp_path / "headless")
    tensors = {k: v for k, v in mx.load(str(tiny / "model.safetensors")).items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(target / "model.safetensors"), tensors, metadata={"format": "pt"})
    index = json.loads((target / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    pack = write_pack(tiny, tmp_path / "pack")
    model, processor, head, info = load_vlm(target, sidecar=pack)
    assert info.sidecar and info.receipt.sidecar.validated and info.refusal is None
    inputs = prepare(model, processor, IMAGE_PROMPT, [image(0)])
    tokens, decoder = generate(model, head, inputs, N, num_draft_tokens=2)
    assert [t for t, _, _ in tokens] == reference(model, inputs, N) and decoder.stats["accepted"] > 0


def test_two_rows_are_refused_typed(loaded):
    model, _, _, _ = loaded
    with pytest.raises(UnsupportedServing) as info:
        model(mx.array([[1, 2], [3, 4]]), model.make_cache())
    assert info.value.reason is RefusalReason.unsupported_model


def test_make_tiny_vision_writes_the_vl_checkpoint(tmp_path, capsys):
    from melix_fsm.cli import main

    out = tmp_path / "vl"
    assert main(["make-tiny", "qwen3_5", str(out), "--vision"]) == 0
    model, _, head, info = load_vlm(out)
    assert info.refusal is None and head is not None and info.vision_tower is not None
    assert main(["make-tiny", "qwen3_5_moe", str(tmp_path / "moe"), "--vision"]) == 0
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["num_experts"] == 4
    assert config["vision_config"]["model_type"] == "qwen3_5_moe"
    keys = set(mx.load(str(tmp_path / "moe" / "model.safetensors")))
    for stem in ("model.language_model.layers.0.mlp", "mtp.layers.0.mlp"):  # as released: fused experts
        assert {f"{stem}.experts.gate_up_proj", f"{stem}.shared_expert_gate.weight"} <= keys
        assert f"{stem}.gate_proj.weight" not in keys
    from mlx_vlm.split_mtp import split_mtp  # mlx-vlm's own reading of the released head layout

    split_mtp(str(tmp_path / "moe"), str(tmp_path / "theirs"))
    theirs = mx.load(str(tmp_path / "theirs" / "model.safetensors"))
    ours = mx.load(str(write_pack(tmp_path / "moe", tmp_path / "ours") / "model.safetensors"))
    assert "layers.0.mlp.switch_mlp.gate_proj.weight" in theirs and sorted(theirs) == sorted(ours)
    assert all(mx.array_equal(theirs[k], ours[k]).item() for k in theirs)
    capsys.readouterr()
    assert main(["make-tiny", "qwen3_next", str(tmp_path / "next"), "--vision"]) == 2
    assert "VL checkpoint of qwen3_5 or qwen3_5_moe only" in capsys.readouterr().err
