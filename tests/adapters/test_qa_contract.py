"""`melix-fsm qa` under the divergence contract: no false alarm in bfloat16, every bug class kept.

Rules of this file:
- The control (mlx-lm's BatchGenerator) on a bfloat16 cast of a tiny checkpoint passes,
  and the report carries the contract (bfloat16, 8 ulps), the tokens compared and the
  rate and histogram of divergences.
- The five planted bug classes (qa_planted_target.five_bugs) are each still found when
  the model is cast to bfloat16 and when its weights are 4-bit (`melix-fsm convert -q`):
  the contract tells a rounding near-tie from the planted wrong token.
- `--exact` turns the contract off (every differing token a bug; the report says so);
  `--near-tie-ulps` must be positive.
- `--simulate-rounding bfloat16` (melix_mlx.tools.qa.simulated) makes near-ties flip on
  this CPU: the control then passes with its near-ties counted under the bfloat16
  contract; the melix target gets the verify-noise class; a factory that loads its own
  model cannot be put under the regime (a usage error, never a silent no-op).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from melix_fsm.cli import main  # noqa: E402

HERE = Path(__file__).parent
FIVE = {
    "generator_raised:IndexError@qa_planted_target.py:_prepare_next_step",
    "generator_raised:KeyError@qa_planted_target.py:_drop_pending",
    "tokens_match_reference:-@later token, joined running batch",
    "tokens_match_reference:-@first token, ragged insert",
    "generator_raised:TypeError@qa_planted_target.py:filter",
}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> str:
    return str(tiny_checkpoint("mimo"))


@pytest.fixture(autouse=True)
def planted_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    sys.modules.pop("qa_planted_target", None)


def qa(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    code = main(["qa", *args, "--quiet"])
    out, err = capsys.readouterr()
    try:
        return code, json.loads(out), err
    except ValueError:
        return code, out, err


def test_the_control_passes_in_bfloat16_with_the_contract_reported(
    capsys: pytest.CaptureFixture[str], model_dir: str
) -> None:
    args = [
        "--model",
        model_dir,
        "--dtype",
        "bfloat16",
        "--temperature",
        "0",
        "--max-examples",
        "3",
        "--seed",
        "1",
    ]
    code, report, err = qa(capsys, "mlx-lm", *args, "--json")
    assert code == 0, (report, err)
    div = report["divergence"]
    assert div["contract"]["dtype"] == "bfloat16" and div["contract"]["ulps"] == 8
    assert div["bugs"] == 0 and div["tokens_compared"] > 50
    assert sum(b["count"] for b in div["histogram"]) == div["divergences"]
    assert report["settings"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "q4"])
def test_every_planted_class_is_still_found(
    capsys: pytest.CaptureFixture[str], model_dir: str, tmp_path: Path, dtype: str
) -> None:
    target, cast = model_dir, dtype
    if dtype == "q4":
        target, cast = str(tmp_path / "q4"), "auto"
        assert main(["convert", "-q", model_dir, target]) == 0
        capsys.readouterr()
    args = [
        "--model",
        target,
        "--dtype",
        cast,
        "--json",
        "--max-examples",
        "3",
        "--draws",
        "300",
        "--seed",
        "1",
    ]
    code, report, err = qa(capsys, "qa_planted_target:five_bugs", *args)
    assert code == 1, err
    found = {b["signature"] for b in report["bugs"]}
    assert found == FIVE, found
    for bug in report["bugs"]:
        if bug["property"] == "tokens_match_reference":
            assert bug["divergence"]["kind"] == "bug" and bug["divergence"]["gap_ulps"] > 8


def test_exact_and_bound_flags() -> None:
    from melix_mlx.commands.qa import make_judge

    exact = argparse.Namespace(exact=True, reference=None, near_tie_ulps=None)
    assert make_judge(exact, model=None) is None
    foreign = argparse.Namespace(exact=False, reference="pkg.mod:fn", near_tie_ulps=None)
    assert make_judge(foreign, model=None) is None  # a foreign reference has no logits to judge by
    assert main(["qa", "mlx-lm", "--model", "stdlib-tiny", "--near-tie-ulps", "0"]) == 2


def test_the_control_under_simulated_rounding_counts_near_ties_and_passes(
    capsys: pytest.CaptureFixture[str], model_dir: str
) -> None:
    args = ["--model", model_dir, "--simulate-rounding", "bfloat16", "--temperature", "0"]
    code, report, err = qa(capsys, "mlx-lm", *args, "--max-examples", "3", "--seed", "1", "--json")
    assert code == 0, (report, err)
    div = report["divergence"]
    assert div["contract"]["dtype"] == "bfloat16" and div["bugs"] == 0
    assert div["near_ties"] > 0  # the regime is live: without the contract these are false alarms
    assert report["settings"]["simulated_rounding"] == "bfloat16"
    assert "simulated bfloat16 rounding" in report["settings"]["target"]


def test_the_regime_reaches_each_kind_of_target(model_dir: str) -> None:
    from melix_mlx.loading import load_with_heads
    from melix_mlx.tools.qa.simulated import NoisyModel, simulated_target
    from melix_mlx.tools.qa.targets import Target, TargetError, resolve_target

    model, _, head, _ = load_with_heads(model_dir)
    melix = simulated_target(resolve_target("melix"), "bfloat16").build(model, head)
    assert type(melix).__name__.startswith("SimulatedRounding_bfloat16") and melix._noise_key
    control = simulated_target(resolve_target("mlx-lm"), "bfloat16").build(model, None)
    assert isinstance(control.model, NoisyModel)
    x = mx.array([[5, 6]])
    noisy, plain = NoisyModel(model, "bfloat16")(x), model(x)
    assert not mx.array_equal(noisy, plain)  # two positions: perturbed
    assert mx.array_equal(NoisyModel(model, "bfloat16")(x[:, :1]), model(x[:, :1]))  # one row: mlx-lm's own
    with pytest.raises(TargetError, match="loads its own model"):
        simulated_target(Target("own", lambda checkpoint=None: None), "bfloat16")
