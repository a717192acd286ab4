"""The MoE families users run: glm4_moe (own GQA head), glm4_moe_lite (latent attention),
qwen3_5_moe (MoE head), qwen3_next.

For each, on a tiny checkpoint written in the family's real Hugging Face layout:
- mlx-lm's own loader reads the main model, and the project loader yields the same logits;
- the receipt admits the family with its own head module;
- greedy MTP decoding equals mlx-lm's greedy output token for token, single sequence at
  k = 1..3 (with a repetition-penalty processor on one prompt) and batched with rows at
  k = 1, 2, 3 in one batch;
- after rejecting cycles the main cache equals a clean run fed only the confirmed tokens
  (qwen3_next: its recurrent layers select the state captured inside the verify);
- a converted directory gives the identical head.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads, safetensors_keys
from melix_mlx.loading.convert import convert
from melix_mlx.loading.heads import HEAD_CLASSES
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.tools.tiny import ALL_FAMILIES, MORE_FAMILIES
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from scripted_head import ScriptedHead
from test_decode_cli import FORCE_ON, greedy, run_json
from test_decode_rollback import CYCLES, PROMPT, clean_cache, max_diff, run_cycles

from melix_fsm.cli import main
from melix_fsm.receipt import resolve
from melix_fsm.registry import registry

N = 14
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [100, 3, 8], [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]]

HF_HEAD_KEYS = {
    "glm4_moe": [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.head.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
    ],
    "glm4_moe_lite": [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
    ],
    "qwen3_5_moe": [
        "mtp.fc.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj",
        "mtp.layers.0.mlp.shared_expert_gate.weight",
        "model.language_model.layers.0.mlp.experts.down_proj",
    ],
    "qwen3_next": [
        "mtp.fc.weight",
        "mtp.layers.0.mlp.experts.3.up_proj.weight",
        "mtp.layers.0.mlp.shared_expert.gate_proj.weight",
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
    ],
}


@pytest.fixture(scope="module")
def family_heads(tiny_checkpoint) -> dict[str, tuple]:
    return {f: (tiny_checkpoint(f), *load_with_heads(tiny_checkpoint(f))) for f in MORE_FAMILIES}


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_hf_layout_loads_with_mlx_lm_and_is_admitted(family_heads, family):
    path, model, _, head, info = family_heads[family]
    keys = {k for f in Path(path).glob("*.safetensors") for k in safetensors_keys(f)}
    assert set(HF_HEAD_KEYS[family]) <= keys
    upstream, _ = mlx_lm.load(str(path))
    x = mx.array([PROMPTS[2]])
    logits, _ = forward_with_hidden(model, x, make_prompt_cache(model))
    assert mx.array_equal(upstream(x), logits)
    assert type(head) is HEAD_CLASSES[family] and info.family == family
    receipt = resolve(path)
    assert receipt.mode == "accepted", receipt.message
    assert (receipt.family, receipt.head_module) == (family, family)


def test_moe_heads_route_through_experts(family_heads):
    """The head layers are MoE (routed + shared experts), not dense stand-ins."""
    for family in MORE_FAMILIES:
        head = family_heads[family][3]
        glm = family.startswith("glm4_moe")
        layer = head.block if glm else head.layers[0]
        assert "switch_mlp" in layer.mlp, family
        assert ("shared_experts" if glm else "shared_expert") in layer.mlp, family


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_greedy_identity_single(family_heads, family, k):
    _, model, _, head, _ = family_heads[family]
    for i, prompt in enumerate(PROMPTS):
        procs = make_logits_processors(repetition_penalty=1.3) if i == 1 else None
        want = reference(model, prompt, N, logits_processors=procs)
        got, decoder = mtp(model, head, prompt, N, k, logits_processors=procs)
        assert got == want, (family, k, i)
        assert decoder.stats["faults"] == 0 and decoder.stats["refusal"] is None
        assert decoder.stats["cycles"] > 0  # it speculated


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_greedy_identity_batched(family_heads, family):
    _, model, _, head, _ = family_heads[family]
    refs = [reference(model, p, N) for p in PROMPTS]
    gen = MTPBatchGenerator(model, head, max_tokens=N)
    assert gen.refusal is None
    uids = gen.insert(PROMPTS, num_draft_tokens=[1, 2, 3])
    out: dict[int, list[int]] = {}
    for _ in range(200):
        if not (gen.batch.uids or gen._queue):
            break
        for r in gen.next()[1]:
            out.setdefault(r.uid, []).append(r.token)
    assert [out[u] for u in uids] == refs
    assert gen.speculative_stats()["cycles"] > 0


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_rollback_cache_equals_clean_run(family_heads, family, monkeypatch):
    _, model, _, head, _ = family_heads[family]
    script = PROMPT + reference(model, PROMPT, 40)
    scripted = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    for name, drafter, k in (("partial", scripted, 3), ("random", head, 2)):
        decoder, kept, _ = run_cycles(model, drafter, k, monkeypatch)
        assert decoder.stats["rollbacks"] == CYCLES, name
        tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
        assert max_diff(decoder.cache, tokenwise) == 0.0, name
        assert decoder.stats["replay_forwards"] == 0


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_converted_dir_gives_identical_head(family_heads, family, tmp_path):
    path, model, tok, head, info = family_heads[family]
    assert info.norms_repaired_on_load == (not family.startswith("glm4_moe"))
    out = convert(path, tmp_path / "converted")
    assert json.loads((out / "config.json").read_text())["melix_mtp"]["family"] == family
    m2, t2, h2, info2 = load_with_heads(out)
    assert info2.head_format == "melix"
    x = mx.array([PROMPTS[2]])
    outs = []
    for m, h in ((model, head), (m2, h2)):
        _, hidden = forward_with_hidden(m, x, make_prompt_cache(m))
        outs.append(h(hidden[:, :-1], x[:, 1:], h.make_cache()))
    for u, v in zip(outs[0], outs[1], strict=True):
        assert mx.abs(u - v).max().item() == 0.0


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_cli_make_tiny_then_generate_prompt_and_prompts_file(family, tmp_path, capsys):
    target = tmp_path / family
    assert main(["make-tiny", family, str(target)]) == 0
    capsys.readouterr()
    common = ("--json", "--max-tokens", "10", "--temp", "0", "--num-draft-tokens", "2", *FORCE_ON)
    model = ("generate", "--model", str(target))
    status, [single], _ = run_json(capsys, *model, "--prompt", "Hi there", *common)
    assert status == 0 and single["receipt"]["family"] == family
    assert single["tokens"] == greedy(target, "Hi there", 10) and single["stats"]["cycles"] > 0
    prompts = ["The cat", "A much longer prompt than the others"]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    status, results, err = run_json(capsys, *model, "--prompts-file", str(tmp_path / "p.json"), *common)
    if set(registry().families[family].cache_kinds) & set(registry().unmergeable):
        # a cache mlx-lm cannot merge (DeepSeek-V4.1's LayerCache): a batch is refused typed
        assert status == 3 and results[-1]["error"] == "unsupported_cache_sharing", err
        return
    assert status == 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result["tokens"] == greedy(target, prompt, 10), prompt
        assert result["stats"]["cycles"] > 0
