"""mlx-vlm's own decoding as a peer (melix_mlx.tools.peers_vlm): what the bench and the qa
kit measure is mlx-vlm's greedy output, token for token mlx-lm's, and the qa glue adds
stops and finishes without changing a token.

On the embedded stdlib-hybrid, which mlx-vlm loads with its MTP drafter as it is. Skipped
when mlx-vlm is not installed (``pip install 'melix-fsm[vlm]'``).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm")

from melix_mlx.loading.checkpoints import resolve_model  # noqa: E402
from melix_mlx.reference import stop_sequences  # noqa: E402
from melix_mlx.tools.peers_vlm import QABatch, decode, load_peer  # noqa: E402

from melix_fsm.testing.reference import cut_at_stop  # noqa: E402

N = 12
PROMPTS = ["def main(): w", "import os\nimport sys\n"]


@functools.cache
def _peer():
    return load_peer(resolve_model("stdlib-hybrid"))


def _greedy(prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens for `prompt` (the identity every contender is held to)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(mx.array(prompt), _mlx_lm_model(), max_tokens=n, sampler=make_sampler(temp=0.0))
    return [int(t) for t, _ in steps]


@functools.cache
def _mlx_lm_model():
    from mlx_lm import load

    return load(str(resolve_model("stdlib-hybrid")))[0]


def _ids() -> list[list[int]]:
    return [_peer().tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("k", [None, 2])
def test_decode_single_and_batched_is_mlx_lm_greedy(k):
    ids = _ids()
    expected = [_greedy(p, N) for p in ids]
    single = decode(_peer(), ids[:1], N, k, batch=False)
    batched = decode(_peer(), ids, N, k, batch=True)
    assert single.tokens == expected[:1]
    assert batched.tokens == expected
    assert batched.decode_tokens == 2 * (N - 1)  # every token after each row's first
    if k is not None:  # the drafter's own record: rounds ran, at most k drafts kept each
        assert batched.cycles > 0 and all(0 <= a <= k for a in batched.accepted)


def test_qa_batch_stops_removes_and_finishes_once():
    ids = _ids()
    expected = [_greedy(p, N) for p in ids]
    stop = (expected[0][4],)  # a token the first request emits: it ends there
    gen = QABatch(_peer(), 2, prefill_batch_size=2, completion_batch_size=3)
    uids = gen.insert(ids, max_tokens=[N, N], stop_sequences=[stop_sequences([stop]), stop_sequences([])])
    tokens = {u: [] for u in uids}
    reasons = {u: [] for u in uids}
    for _ in range(4 * N):
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
            reasons[r.uid].append(r.finish_reason)
    gen.close()
    assert tokens[uids[0]] == list(cut_at_stop(expected[0], [stop]))
    assert tokens[uids[1]] == expected[1]
    assert [x for x in reasons[uids[0]] if x] == ["stop"] and reasons[uids[0]][-1] == "stop"
    assert [x for x in reasons[uids[1]] if x] == ["length"] and reasons[uids[1]][-1] == "length"


def test_bench_peer_runs_in_one_regime(tmp_path):
    from melix_fsm.cli import main

    argv = ["bench", "--peer", "mlx-vlm", "--model", "stdlib-hybrid", "--regime", "both"]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 2  # refused before any worker starts: the peers run in one regime
