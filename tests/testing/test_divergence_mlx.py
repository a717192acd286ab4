"""The divergence contract on real tiny checkpoints: bfloat16, 4-bit weights, simulated rounding.

Rules of this file:
- Each regime loads its own copy of a tiny checkpoint (the session's shared one is
  never cast): `bfloat16` (model and head cast), `q4` (main model quantized to 4 bits,
  group 32) and `simulated` (float32 weights, the verify's logits perturbed by up to 3
  bfloat16 ulps of their largest value: melix_mlx.tools.qa.margins.simulated_rounding),
  judged by the contract of the regime's logits dtype (bfloat16 for the simulated one).
- One fixed schedule reaches every planted cycle bug: ragged prompts, a queued third
  request, a row finishing while others go on (a filter), a join into the running batch,
  drafts of 1-3. The head is the scripted one (tests/adapters/scripted_head.py, as the
  conftest's `scripted`): right except every third prefix, so rows accept different
  numbers of drafts (a rollback into the wrong row shows).
- The correct generator passes in every regime with zero bugs judged (its near-ties, if
  any, are counted); every planted cycle bug (off-by-one acceptance, stale row after
  filter, wrong rollback) fails `tokens_match_reference` with a gap judged a bug.
- Budget: one schedule per case on hidden-64 checkpoints; the file runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from melix_mlx.batch_generator import MTPBatchGenerator  # noqa: E402
from melix_mlx.tools.qa.margins import contract_judge, logits_dtype, logits_of, simulated_rounding  # noqa: E402

from melix_fsm.testing import ConformanceError, mlx_greedy_reference, replay  # noqa: E402
from melix_fsm.testing.divergence import BUG, NEAR_TIE, judge_for  # noqa: E402

from .broken_generators import CYCLE_BUGS  # noqa: E402

REGIMES = ("bfloat16", "q4", "simulated")


def request(prompt: list[int], n: int, k: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n, "stops": [], "options": {"num_draft_tokens": k}}


SCHEDULE = [
    {
        "op": "insert",
        "requests": [request([5, 9, 13], 3, 2), request([7, 11], 14, 2), request([4, 6, 8, 10], 14, 3)],
    },
    {"op": "next"},
    {"op": "next"},
    {"op": "insert", "requests": [request([12, 3, 5], 12, 1)]},
    {"op": "drain"},
]


@pytest.fixture(scope="module")
def regimes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Any, Any]]:
    from melix_mlx.loading import load_with_heads
    from melix_mlx.tools.tiny import make_tiny
    from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE

    from .conftest import _scripted_head_class

    directory = make_tiny("mimo", Path(tmp_path_factory.mktemp("divergence")) / "mimo", seed=3)
    loaded: dict[str, tuple[Any, Any, Any]] = {}

    def get(regime: str) -> tuple[Any, Any, Any]:
        if regime not in loaded:
            model, _, head, _ = load_with_heads(directory)
            if regime == "bfloat16":
                model.set_dtype(mx.bfloat16)
                head.set_dtype(mx.bfloat16)
            elif regime == "q4":
                nn.quantize(model, group_size=32, bits=4)
            mx.eval(model.parameters(), head.parameters())
            scripted = _scripted_head_class()([], VOCAB_SIZE, 8, wrong_every=3)
            greedy = mlx_greedy_reference(model, min_tokens=16)

            def reference(prompt: tuple[int, ...], max_tokens: int, scripted: Any = scripted) -> Any:
                out = greedy(prompt, max_tokens)
                seen = list(prompt[1:]) + list(out)  # the head's slot convention (conftest.scripted)
                for m in range(1, len(seen)):
                    scripted.table.setdefault(tuple(seen[:m]), seen[m])
                return out

            loaded[regime] = (model, scripted, reference)
        return loaded[regime]

    return get


def run(regimes: Callable, regime: str, cls: type) -> Any:
    model, head, reference = regimes(regime)
    if regime == "simulated":
        cls = simulated_rounding("bfloat16", base=cls)
        judge = judge_for(logits_of(model), "bfloat16")
    else:
        judge = contract_judge(model)
    make = lambda: cls(model, head, num_draft_tokens=2, prefill_batch_size=2, completion_batch_size=3)  # noqa: E731
    try:
        replay(SCHEDULE, make, reference, judge=judge)
    except ConformanceError as err:
        return err, judge
    return None, judge


@pytest.mark.parametrize("regime", REGIMES)
def test_the_correct_generator_has_no_bug_in_any_regime(regimes: Callable, regime: str) -> None:
    err, judge = run(regimes, regime, MTPBatchGenerator)
    assert err is None, err
    assert judge.ledger.count(BUG) == 0 and judge.ledger.tokens >= 20
    if regime == "simulated":  # the seeded noise flips a real near-tie of this schedule
        assert judge.ledger.count(NEAR_TIE) >= 1 and all(d.ulps <= 6 for d in judge.ledger.divergences)
    expected = {"bfloat16": "bfloat16", "q4": "float32", "simulated": "bfloat16"}[regime]
    assert judge.contract.dtype == expected


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("bug", sorted(CYCLE_BUGS))
def test_planted_cycle_bugs_stay_bugs(regimes: Callable, regime: str, bug: str) -> None:
    err, judge = run(regimes, regime, CYCLE_BUGS[bug])
    assert err is not None and err.prop == "tokens_match_reference", err
    assert err.divergence is not None and err.divergence.kind == BUG, err.divergence
    assert err.divergence.ulps > judge.contract.ulps


def test_logits_dtype_follows_the_cast(regimes: Callable) -> None:
    assert logits_dtype(regimes("bfloat16")[0]) == "bfloat16"
    assert logits_dtype(regimes("q4")[0]) == "float32"
