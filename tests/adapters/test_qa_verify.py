"""`melix-fsm verify --model M`: one command that checks MTP against mlx-lm on the user's machine.

Rules of this file:
- The smoke profile (one schedule of 8 tokens, 6 probes, 100 draws) passes on an
  embedded checkpoint cast to bfloat16: exit 0, every part reported with its tokens and
  time, the contract in the logits' dtype, the promise and the receipt in the report;
  `--out FILE` writes the same report.
- An off-by-one acceptance planted in the cycle engine (both decode paths) is found:
  exit 1, a `tokens_match_reference` bug whose measured gap the contract calls a bug,
  the verdict and "none" as the promise.
- Usage errors exit 2 with one line.
- The whole matrix the docs' identity table reports (both embedded checkpoints in
  float32, bfloat16 and 4-bit from `melix-fsm convert -q`) is a slow test, at the smoke
  profile; the table's figures come from the quick profile (docs/conformance.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from melix_fsm.cli import main  # noqa: E402

SMOKE = ["--profile", "smoke", "--draws", "100", "--seed", "1", "--json", "--quiet"]
PARTS = {
    "identity, batched",
    "identity, single-sequence",
    "batch invariance (vs lone run)",
    "lifecycle and edge-case probes",
    "distribution (100 draws, T = 1)",
}


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    try:
        return code, json.loads(out), err
    except ValueError:
        return code, out, err


def test_smoke_passes_in_bfloat16(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code, report, err = verify(
        capsys, "--model", "stdlib-tiny", "--dtype", "bfloat16", *SMOKE, "--out", str(out)
    )
    assert code == 0, (report, err)
    assert report["verdict"] == "pass" and report["bugs"] == []
    assert report["identity"] in ("bit-exact", "within contract")
    assert set(report["parts"]) == PARTS
    assert all(p["result"] != "FAIL" for p in report["parts"].values())
    assert report["parts"]["identity, batched"]["tokens"] > 0
    div = report["divergence"]
    assert div["contract"]["dtype"] == "bfloat16" and div["bugs"] == 0 and div["tokens_compared"] >= 100
    assert len(report["invariance"]) == 6 and report["distribution"]["draws"] == 100
    assert report["receipt"]["mode"] == "accepted" and report["receipt"]["resolved_method"] == "mtp"
    assert "bfloat16" in report["promise"] and report["settings"]["mlx_lm"]
    assert report["settings"]["weights"] == "dense"
    assert json.loads(out.read_text()) == report


def test_a_planted_acceptance_bug_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import melix_mlx.runtime.engine as engine_mod

    original = engine_mod.CycleEngine._accept

    def one_more(self: Any, plans: Any, ks: Any, K: int, *rest: Any) -> Any:
        accepted, bonus = original(self, plans, ks, K, *rest)
        return mx.minimum(accepted + 1, mx.array(ks, dtype=accepted.dtype)), bonus

    monkeypatch.setattr(engine_mod.CycleEngine, "_accept", one_more)
    code, report, _ = verify(capsys, "--model", "stdlib-tiny", *SMOKE)
    assert code == 1 and report["verdict"] == "fail" and report["identity"] == "FAIL"
    wrong = [b for b in report["bugs"] if b["property"] == "tokens_match_reference"]
    assert wrong and wrong[0]["divergence"]["kind"] == "bug" and wrong[0]["schedule"]
    assert {b["part"] for b in wrong} >= {"identity, batched", "identity, single"}
    assert report["promise"].startswith("none")


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "stdlib-tiny", "--max-tokens", "2"],
        ["--model", "/nowhere"],
        ["--model", "stdlib-tiny", "-k", "0"],
        ["--model", "stdlib-tiny", "--out", "/nowhere/report.json"],
    ],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    code, _, err = verify(capsys, *args, "--quiet")
    assert code == 2 and err.count("\n") == 1 and err.startswith("melix-fsm verify: error:")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["stdlib-tiny", "stdlib-hybrid"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q4"])
def test_the_matrix_passes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: str, dtype: str
) -> None:
    target, cast = model, dtype
    if dtype == "q4":
        target, cast = str(tmp_path / "q4"), "auto"
        assert main(["convert", "-q", model, target]) == 0
        capsys.readouterr()
    code, report, err = verify(capsys, "--model", target, "--dtype", cast, *SMOKE)
    assert code == 0, (report, err)
    assert report["divergence"]["bugs"] == 0
    assert report["settings"]["weights"] == ("4-bit, group 64" if dtype == "q4" else "dense")
