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
