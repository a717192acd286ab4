"""Multi-layer heads: every advertised layer is loaded, draft step i runs layer i.

On tiny checkpoints written with ``--mtp-layers 2`` (DeepSeek-V3: pre-norm chaining,
separate modules; Qwen3.5: shared fc/norms around per-step layers):
- the CLI writes both layers under the family's real key names and count key;
- ``load_with_heads`` returns a two-layer head; receipt and HeadInfo say two layers;
- greedy MTP output equals mlx-lm's, single (k = 1..3) and batched;
- changing only layer 1's weights changes the drafts of steps >= 1 while the output
  stays exact: the second layer is what drafts them;
- ``convert`` keeps both layers and the converted head drafts identically.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads, safetensors_keys
from melix_mlx.loading.convert import convert
from melix_mlx.loading.heads.stacked import StackedHead
from melix_mlx.runtime.hidden import main_parts
from mlx.utils import tree_flatten, tree_map

from melix_fsm.cli import main

FAMILIES = ("deepseek_v3", "qwen3_5")
LAYER1_KEY = {
    "deepseek_v3": "model.layers.4.eh_proj.weight",
    "qwen3_5": "mtp.layers.1.self_attn.q_proj.weight",
}
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [72, 101, 108, 108, 111, 44, 32, 119]]
N = 14


@pytest.fixture(scope="module")
def two_layer(tmp_path_factory) -> dict[str, tuple]:
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp("multi") / family
        assert main(["make-tiny", family, str(path), "--mtp-layers", "2"]) == 0
        out[family] = (path, *load_with_heads(path))
    return out


def _recording(head: StackedHead) -> list[tuple[int, list[int]]]:
    """Wrap ``chain_step`` to record (step, drafted tokens) of every chained draft."""
    seen: list[tuple[int, list[int]]] = []
    inner = head.chain_step

    def chain_step(step, hidden, tokens):
        logits, out = inner(step, hidden, tokens)
        seen.append((step, mx.argmax(logits[:, -1], axis=-1).tolist()))
        return logits, out

    object.__setattr__(head, "chain_step", chain_step)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_both_layers_written_loaded_and_declared(two_layer, family):
    path, _, _, head, info = two_layer[family]
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["num_nextn_predict_layers" if family == "deepseek_v3" else "mtp_num_hidden_layers"] == 2
    keys = {k for f in path.glob("*.safetensors") for k in safetensors_keys(f)}
    assert LAYER1_KEY[family] in keys
    assert isinstance(head, StackedHead) and len(head.heads) == 2
    assert [head.layer_for_step(i) for i in range(4)] == [0, 1, 1, 1]
    assert info.head_layers == 2 and info.advertised_layers == 2
    assert info.receipt.head_count == 2 and info.refusal is None
    assert "draft step i runs layer min(i, 1)" in info.receipt.message
    # the two layers hold different trained tensors, not one layer reused
    a, b = (dict(tree_flatten(h.parameters())) for h in head.heads)
    assert any(not mx.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_single_and_batched(two_layer, family):
    _, model, _, head, _ = two_layer[family]
    refs = [reference(model, p, N) for p in PROMPTS]
    for k in (1, 2, 3):
        for prompt, want in zip(PROMPTS, refs):
            got, decoder = mtp(model, head, prompt, N, k)
            assert got == want, (family, k)
            assert decoder.stats["cycles"] > 0 and decoder.stats["faults"] == 0
    gen = MTPBatchGenerator(model, head, max_tokens=N)
    uids = gen.insert(PROMPTS, num_draft_tokens=[3, 2])
    out: dict[int, list[int]] = {}
    while gen.batch.uids or gen._queue:
        for r in gen.next()[1]:
            out.setdefault(r.uid, []).append(r.token)
    assert [out[u] for u in uids] == refs


@pytest.mark.parametrize("family", FAMILIES)
def test_second_layer_weights_change_the_drafts(tiny_checkpoint, family):
    path = tiny_checkpoint(family, mtp_layers=2)
    runs = []
    for perturb in (False, True):
        model, _, head, _ = load_with_heads(path)
        if perturb:  # layer 1 only: scale every weight matrix
            head.heads[1].update(
                tree_map(lambda v: v * 1.7 if v.ndim >= 2 else v, head.heads[1].parameters())
            )
        seen = _recording(head)
        got, _ = mtp(model, head, PROMPTS[1], N, 3)
        assert got == reference(model, PROMPTS[1], N)  # exact either way
        runs.append(seen)
    base, perturbed = runs
    assert {s for s, _ in base} == {1, 2}  # steps 1 and 2 ran, both on layer 1
    assert [t for _, t in base] != [t for _, t in perturbed]  # layer 1 drafted them


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_every_layer(two_layer, family, tmp_path):
    path, model, _, head, _ = two_layer[family]
    out = convert(path, tmp_path / "converted")
    record = json.loads((out / "config.json").read_text())["melix_mtp"]
    assert record["head_layers"] == 2
    keys = set(safetensors_keys(out / "mtp.safetensors"))
    assert any(k.startswith("melix_mtp.heads.1.") for k in keys)
    m2, _, h2, info2 = load_with_heads(out)
    assert isinstance(h2, StackedHead) and info2.head_layers == 2 and info2.head_format == "melix"
    x = mx.array([[3, 141, 59, 26]])
    h = mx.random.normal((1, 1, main_parts(model).args.hidden_size))
    for step in (1, 2):
        for stacked in (head, h2):
            stacked._scratch.caches = {}
        want = head.chain_step(step, h, x[:, :1])[0]
        assert mx.array_equal(h2.chain_step(step, h, x[:, :1])[0], want)
