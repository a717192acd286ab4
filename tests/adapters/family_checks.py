"""The checks every runnable family's test file runs on its own tiny checkpoints.

Rules of this file:
- Each check takes a loaded model and head (and the file's prompts) and asserts one
  property against mlx-lm's own greedy decode; the family files parametrize over their
  families and call these, so a property reads the same for every family.
- `greedy_identity_single`: one sequence at a time (the second prompt under a repetition
  penalty) equals mlx-lm's greedy output, with no fault or refusal and cycles run.
- `batched_identity`: MTPBatchGenerator rows at k = 1, 2, 3 in one batch, a row removed
  mid-run (its tokens stay a prefix), a late joiner; every row equals mlx-lm's greedy.
- `rollback_equals_clean_run`: after rejecting cycles (a scripted head wrong every third
  draft, then the random head) the main cache equals a clean token-by-token run over the
  confirmed tokens, bit for bit, and nothing was replayed.
- `four_bit_identity`: a 4-bit conversion keeps the head and greedy identity, with
  rollbacks (the scripted head's wrong drafts) exercised.
- `hf_layout_admitted`: the checkpoint holds the family's head tensors under their
  published names, mlx-lm's own loader reads it and the project loader gives the same
  logits bit for bit, the head is the family's own single-layer module, and the receipt
  admits the family with its own head module under every serving context given.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from decode_refs import mtp, reference
from melix_mlx.batch_generator import MTPBatchGenerator
from melix_mlx.loading import load_with_heads, safetensors_keys
from melix_mlx.loading.convert import convert
from melix_mlx.loading.heads import HEAD_CLASSES
from melix_mlx.runtime.hidden import forward_with_hidden, main_parts
from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from scripted_head import ScriptedHead
from test_decode_rollback import CYCLES, PROMPT, clean_cache, max_diff, run_cycles

from melix_fsm.receipt import Receipt, ServingContext, resolve


def greedy_identity_single(model: Any, head: Any, prompts: list[list[int]], n: int, k: int) -> list[Any]:
    """Returns each prompt's decoder, for a family's own further assertions."""
    decoders = []
    for i, prompt in enumerate(prompts):
        procs = make_logits_processors(repetition_penalty=1.3) if i == 1 else None
        want = reference(model, prompt, n, logits_processors=procs)
        got, decoder = mtp(model, head, prompt, n, k, logits_processors=procs)
        assert got == want, (k, i)
        assert decoder.stats["faults"] == 0 and decoder.stats["refusal"] is None
        assert decoder.stats["cycles"] > 0
        decoders.append(decoder)
    return decoders


def batched_identity(
    model: Any, head: Any, prompts: list[list[int]], late_prompt: list[int], n: int
) -> dict[str, Any]:
    """Returns the run's speculative stats, for a family's own further assertions."""
    refs = [reference(model, p, n) for p in prompts]
    gen = MTPBatchGenerator(model, head, max_tokens=n)
    assert gen.refusal is None
    uids = gen.insert(prompts, num_draft_tokens=[1, 2, 3])
    out: dict[int, list[int]] = {u: [] for u in uids}
    late = None
    for step in range(200):
        if not (gen.batch.uids or gen._queue):
            break
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
        if step == 2:
            gen.remove([uids[1]])
        if step == 3:
            (late,) = gen.insert([late_prompt], num_draft_tokens=[2])
            out[late] = []
    assert out[uids[0]] == refs[0] and out[uids[2]] == refs[2]
    assert 0 < len(out[uids[1]]) < n and out[uids[1]] == refs[1][: len(out[uids[1]])]
    assert late is not None and out[late] == reference(model, late_prompt, n)
    stats = gen.speculative_stats()
    assert stats["cycles"] > 0
    gen.close()
    return stats


def rollback_equals_clean_run(model: Any, head: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    script = PROMPT + reference(model, PROMPT, 40)
    scripted = ScriptedHead([script], VOCAB_SIZE, main_parts(model).args.hidden_size, wrong_every=3)
    for name, drafter, k in (("partial", scripted, 3), ("random", head, 2)):
        decoder, kept, _ = run_cycles(model, drafter, k, monkeypatch)
        assert decoder.stats["rollbacks"] == CYCLES, name
        tokenwise = clean_cache(model, [[t] for chunk in kept for t in chunk])
        assert max_diff(decoder.cache, tokenwise) == 0.0, name
        assert decoder.stats["replay_forwards"] == 0


def four_bit_identity(path: Path, family: str, tmp_path: Path, prompts: list[list[int]], n: int) -> None:
    out = convert(path, tmp_path / f"{family}-q4", quantize=True, q_group_size=32)
    model, _, head, info = load_with_heads(out)
    assert info.main_quantized and info.family == family
    hidden = main_parts(model).args.hidden_size
    rollbacks = 0
    for prompt in prompts:
        want = reference(model, prompt, n)
        scripted = ScriptedHead([prompt + reference(model, prompt, n + 4)], VOCAB_SIZE, hidden, wrong_every=3)
        for k in (1, 2):
            assert mtp(model, head, prompt, n, k)[0] == want
            got, decoder = mtp(model, scripted, prompt, n, k)
            assert got == want and decoder.stats["accepted"] > 0
            rollbacks += decoder.stats["rollbacks"]
    assert rollbacks > 0  # the scripted head's wrong drafts were rolled back


def hf_layout_admitted(
    loaded: tuple,
    family: str,
    head_keys: Iterable[str],
    prompt: list[int],
    contexts: tuple[ServingContext, ...] = (ServingContext(),),
) -> list[Receipt]:
    """`loaded` is (path, model, tokenizer, head, info). Returns the receipts (one per
    context), for a family's own further assertions."""
    path, model, _, head, info = loaded
    keys = {k for f in Path(path).glob("*.safetensors") for k in safetensors_keys(f)}
    assert set(head_keys) <= keys, sorted(set(head_keys) - keys)
    upstream, _ = mlx_lm.load(str(path))
    x = mx.array([prompt])
    logits, _ = forward_with_hidden(model, x, make_prompt_cache(model))
    assert mx.array_equal(upstream(x), logits)
    assert type(head) is HEAD_CLASSES[family] and info.family == family and info.head_layers == 1
    receipts = [resolve(path, context=context) for context in contexts]
    for receipt in receipts:
        assert receipt.mode == "accepted", receipt.message
        assert (receipt.family, receipt.head_module) == (family, family)
    return receipts
