"""The draft-model method: a separate model drafts through the same engine, lifecycle and receipts.

Greedy output equals mlx-lm's own greedy decoding (and mlx-lm's own draft-model
decoding) at depths 1-3, single and batched; the CLI runs `--method draft_model
--draft-model DIR` with the receipt admitting it; tokenizers are compared themselves;
a draft whose cache cannot be rolled back in the head slot is refused, typed.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from compat_models import make_llama
from decode_refs import mtp, reference
from melix_mlx.decoding.draft_model import DraftHead, check_tokenizers, load_draft
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.loading.errors import UnsupportedServing
from mlx_lm.generate import speculative_generate_step
from mlx_lm.utils import load_model, load_tokenizer

from melix_fsm.cli import main
from melix_fsm.config import speculative_config
from melix_fsm.reasons import RefusalReason
from melix_fsm.receipt import Mode, resolve

TEXTS = ["import os\ndef main():\n    ", "class Foo:\n    def __init__(self"]
N = 24


@pytest.fixture(scope="module")
def pair() -> tuple:
    from melix_mlx.loading import load_main

    target_dir = resolve_model("stdlib-tiny")

    model, config = load_main(target_dir)
    tokenizer = load_tokenizer(target_dir, eos_token_ids=config.get("eos_token_id"))
    head, _ = load_draft(resolve_model("stdlib-tiny-draft"), tokenizer)
    return model, tokenizer, head


def test_greedy_identity_and_mlx_lm_draft_decoding(pair) -> None:
    model, tokenizer, head = pair
    accepted = 0
    for text, depths in zip(TEXTS, [(1, 3), (2,)]):
        prompt = tokenizer.encode(text)
        want = reference(model, prompt, N)
        theirs = speculative_generate_step(
            mx.array(prompt), model, head.draft, num_draft_tokens=2, max_tokens=N
        )
        assert [int(t) for t, _, _ in theirs] == want
        for k in depths:
            got, decoder = mtp(model, head, prompt, N, k)
            assert got == want, (text, k)
            assert decoder.stats["refusal"] is None and decoder.stats["cycles"] > 0
            accepted += decoder.stats["accepted"]
    assert accepted > 0  # the draft model really drafts for this target


def test_batched_identity(pair) -> None:
    from melix_mlx.batch_generator import MTPBatchGenerator

    model, tokenizer, head = pair
    prompts = [tokenizer.encode(t) for t in TEXTS]
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, max_tokens=N)
    uids = gen.insert(prompts)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()
    for uid, prompt in zip(uids, prompts):
        assert out[uid] == reference(model, prompt, N)


def test_cli_runs_the_draft_model(pair, capsys) -> None:
    model, tokenizer, _ = pair
    argv = ["generate", "--model", "stdlib-tiny", "--prompt", TEXTS[0], "--max-tokens", str(N), "--json"]
    argv += ["--method", "draft_model", "--draft-model", "stdlib-tiny-draft", "--device-policy", "force_on"]
    argv += ["--num-draft-tokens", "2"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "draft_model" and result["receipt"]["mode"] == "accepted"
    assert result["receipt"]["resolved_method"] == "draft_model"
    want = reference(model, tokenizer.encode(TEXTS[0]), N)
    assert result["tokens"] == want[: len(result["tokens"])] and result["tokens"]
    assert result["stats"]["cycles"] > 0 and result["stats"]["accepted"] > 0


def test_tokenizers_compared_themselves(tmp_path, capsys) -> None:
    draft_dir = make_llama(tmp_path / "draft")
    vocab_file = draft_dir / "tokenizer.json"
    data = json.loads(vocab_file.read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # swap two ids: same size, different map
    vocab[a], vocab[b] = vocab[b], vocab[a]
    vocab_file.write_text(json.dumps(data))
    target = load_tokenizer(resolve_model("stdlib-tiny"))
    with pytest.raises(UnsupportedServing) as err:
        check_tokenizers(target, load_tokenizer(draft_dir))
    assert err.value.reason is RefusalReason.vocab_mismatch
    config = speculative_config(method="draft_model", draft_model=str(draft_dir))
    receipt = resolve(resolve_model("stdlib-tiny"), config)
    assert receipt.mode is Mode.refused and receipt.refusal_reason is RefusalReason.vocab_mismatch
    argv = ["generate", "--model", "stdlib-tiny", "--prompt", "x", "--method", "draft_model"]
    assert main([*argv, "--draft-model", str(draft_dir)]) == 3
    assert json.loads(capsys.readouterr().out)["error"] == "vocab_mismatch"


def test_recurrent_draft_is_refused_typed(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3_5")
    draft, _ = load_model(path, strict=False)
    with pytest.raises(UnsupportedServing) as err:
        DraftHead(draft)
    assert err.value.reason is RefusalReason.unsupported_cache_sharing
    config = speculative_config(method="draft_model", draft_model=str(path))
    receipt = resolve(tiny_checkpoint("qwen3_5", seed=1), config)
    assert receipt.refusal_reason is RefusalReason.unsupported_cache_sharing
