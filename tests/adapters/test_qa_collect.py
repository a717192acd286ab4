"""benchmarks/gpu.sh's exactness file: melix_mlx.tools.qa.collect over verify reports and gallery cells.

Rules of this file:
- Every verify report and gallery cell lands in exactness.json with its verdict and
  divergence figures; the exit status is 0 only when all passed; an unreadable report
  is recorded as missing (exit 1), never skipped. Plain JSON, no model: milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

from melix_mlx.tools.qa.collect import main


def report(verdict: str, near: int) -> dict:
    ledger = {"tokens_compared": 100, "near_ties": near, "bugs": 0, "per_1000_tokens": {"all": near * 10.0}}
    return {
        "verdict": verdict,
        "identity": "within contract" if near else "bit-exact",
        "promise": "...",
        "divergence": {**ledger, "histogram": [], "records": []},
        "parts": {"identity, batched": {"result": "pass", "seconds": 1.5}},
        "settings": {"model": "stdlib-tiny"},
    }


def write(results: Path, verify: dict[str, object], cells: list[dict]) -> None:
    (results / "verify").mkdir(parents=True)
    (results / "device.json").write_text(json.dumps({"default_device": "Device(gpu, 0)"}))
    for name, doc in verify.items():
        text = doc if isinstance(doc, str) else json.dumps(doc)
        (results / "verify" / f"{name}.json").write_text(text)
    (results / "gallery.json").write_text(json.dumps({"cells": cells}))


CELL = {"target": "planted", "model": "stdlib-tiny", "regime": "q4", "ok": True, "near_ties": 0, "bugs": []}


def test_all_pass(tmp_path: Path, capsys) -> None:
    write(
        tmp_path,
        {"stdlib-tiny-float32": report("pass", 0), "stdlib-tiny-bfloat16": report("pass", 2)},
        [CELL],
    )
    assert main([str(tmp_path)]) == 0
    out = json.loads((tmp_path / "exactness.json").read_text())
    assert out["device"]["default_device"] == "Device(gpu, 0)"
    assert out["verify"]["stdlib-tiny-bfloat16"]["near_ties"] == 2
    assert out["verify"]["stdlib-tiny-bfloat16"]["identity"] == "within contract"
    assert out["gallery"] == [CELL]
    assert capsys.readouterr().out.count("\n") == 3


def test_a_failure_or_an_unreadable_report_fails(tmp_path: Path) -> None:
    write(tmp_path / "a", {"x": report("fail", 0)}, [CELL])
    assert main([str(tmp_path / "a")]) == 1
    write(tmp_path / "b", {"x": report("pass", 0), "y": "{cut"}, [CELL])
    assert main([str(tmp_path / "b")]) == 1
    assert json.loads((tmp_path / "b" / "exactness.json").read_text())["verify"]["y"]["verdict"] == "missing"
    write(tmp_path / "c", {"x": report("pass", 0)}, [{**CELL, "ok": False}])
    assert main([str(tmp_path / "c")]) == 1
    assert main([str(tmp_path / "nowhere")]) == 2
