"""Checkpoints whose own config has sliding-window layers, speculated on exactly.

The MTP families with sliding layers (MiMo-V2-Flash, Step-3.5, EXAONE MoE) have their own
tests (test_family_swa.py); mimo / qwen2 read neither `use_sliding_window` nor
`layer_types` (spec/families.toml). Here the window comes from a llama config whose
`layer_types` marks a sliding layer: mlx-lm's `make_cache` gives
that layer a RotatingKVCache (window 8 here) and the other a KVCache, and the draft-model
method speculates on it. Single sequence: greedy output equals mlx-lm's own decode token
for token with a prompt longer than the window (a scripted head wrong every fifth draft,
so rollbacks run, and a real draft model). Batched: admitted by the receipt and the batch
generator (melix_mlx.runtime.window_batch; identity under continuous batching:
tests/adapters/test_batched_windows.py), and the CLI's batched generate equals mlx-lm's
output per prompt; a quantized window is refused `unsupported_quantization`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from compat_models import make_llama
from decode_refs import mtp, reference
from melix_mlx.decoding.draft_model import DraftHead
from melix_mlx.runtime.window_kv import WindowedKVCache
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model
from scripted_head import ScriptedHead

from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import Mode, ServingContext, resolve

WINDOW = 8
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 5, 17, 33, 2, 40, 41, 42, 43, 44, 45, 46]  # > WINDOW
N = 32


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    target = make_llama(root / "target", seed=1, **SLIDING)
    full = root / "full"  # the same weights, every layer full attention
    shutil.copytree(target, full)
    config = json.loads((full / "config.json").read_text())
    del config["layer_types"]
    (full / "config.json").write_text(json.dumps(config))
    return {"target": target, "full": full, "draft": make_llama(root / "draft", seed=2)}


@pytest.fixture(scope="module")
def target(dirs):
    model, _ = load_model(dirs["target"])
    return model


def test_mlx_lm_windows_the_sliding_layer(dirs, target) -> None:
    assert [type(c) for c in make_prompt_cache(target)] == [RotatingKVCache, KVCache]
    full, _ = load_model(dirs["full"])
    assert reference(target, PROMPT, N) != reference(full, PROMPT, N)  # the window changes the output


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_mlx_lm_on_sliding_layers(dirs, target, k: int) -> None:
    want = reference(target, PROMPT, N)
    script = PROMPT + reference(target, PROMPT, N + 4)
    scripted = ScriptedHead([script], 1024, 64, wrong_every=5)
    draft, _ = load_model(dirs["draft"])
    for drafter in (scripted, DraftHead(draft)):
        got, decoder = mtp(target, drafter, PROMPT, N, k)
        assert got == want, (k, type(drafter).__name__)
        assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0
        assert [type(c) for c in decoder.cache] == [WindowedKVCache, KVCache]
    got, decoder = mtp(target, scripted, PROMPT, N, k)
    assert decoder.stats["accepted"] > 0 and decoder.stats["rollbacks"] > 0


def test_receipt_plans_the_window_single_and_batched(dirs) -> None:
    config = speculative_config(method="draft_model", draft_model=str(dirs["draft"]))
    for context in (ServingContext(), ServingContext(batched=True)):
        receipt = resolve(dirs["target"], config, context=context)
        assert receipt.mode is Mode.accepted, receipt.message
        plans = [(p.kind, p.strategy) for p in receipt.caches]
        assert plans == [("kv", "trim"), ("rotating", "window_spare")]
    quantized = ServingContext(quantized_kv=True, kv_group_size=16)  # 16 divides the head dim
    refused = resolve(dirs["target"], config, context=quantized)
    assert refused.refusal_reason is RefusalReason.unsupported_quantization and "rotating" in refused.message


def test_cli_single_equals_mlx_lm(dirs, target, capsys) -> None:
    from mlx_lm import generate
    from mlx_lm.utils import load_tokenizer

    from melix_fsm.cli import main

    prompt = "The morning light fell across the old stone bridge"
    argv = ["generate", "--model", str(dirs["target"]), "--prompt", prompt, "--max-tokens", str(N), "--json"]
    argv += ["--method", "draft_model", "--draft-model", str(dirs["draft"]), "--device-policy", "force_on"]
    assert main([*argv, "--num-draft-tokens", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "draft_model" and result["stats"]["cycles"] > 0
    assert result["prompt_tokens"] > WINDOW
    assert {p["kind"]: p["strategy"] for p in result["receipt"]["caches"]}["rotating"] == "window_spare"
    tokenizer = load_tokenizer(dirs["target"])
    assert result["text"] == generate(target, tokenizer, prompt, max_tokens=N)


def test_batches_run_from_the_cli_equal_to_mlx_lm(dirs, target, tmp_path, capsys) -> None:
    from mlx_lm.utils import load_tokenizer

    from melix_fsm.cli import main

    lines = ["The morning light fell across the old stone bridge", "import os"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    argv = ["generate", "--model", str(dirs["target"]), "--prompts-file", str(prompts), "--json"]
    argv += ["--method", "draft_model", "--draft-model", str(dirs["draft"]), "--max-tokens", str(N)]
    assert main([*argv, "--device-policy", "force_on", "--num-draft-tokens", "2"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokenizer = load_tokenizer(dirs["target"])
    assert results[0]["prompt_tokens"] > WINDOW
    for line, result in zip(lines, results, strict=True):
        assert result["stats"]["refusal"] is None and result["stats"]["cycles"] > 0
        prompt = tokenizer.encode(line)
        assert result["prompt_tokens"] == len(prompt)
        assert result["tokens"] == reference(target, prompt, N)
