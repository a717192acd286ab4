"""The family table's efficiency cell: every recorded shape, each labelled with where it came from.

The controlled-acceptance results (benchmarks/results/controlled-acceptance.json) keep one
profile per shape (schema /2); the docs hook (docs/hooks/melix_docs.py) shows the tiny
checkpoints' figures first, then every widened profile, each with its clock and the load
recorded beside it, and reads an older one-shape file (/1) as the tiny profile. Without
mkdocs (the hook imports it) the test skips.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hook() -> ModuleType:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs (docs extra) is not installed")
    spec = importlib.util.spec_from_file_location("melix_docs_hook", ROOT / "docs/hooks/melix_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _family(b1: float, b4: float | None, **extra: object) -> dict[str, object]:
    return {"batch_1": b1, "batch_4": b4, "batch_1_quartiles": [b1 - 0.05, b1 + 0.05], **extra}


def test_every_profile_is_shown_with_its_shape_clock_and_load(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    wide = _family(0.97, 0.91, clock="cpu", load_average={"start": [5.25, 5.0, 4.0], "end": [6.5, 5.0, 4.0]})
    results.write_text(
        json.dumps(
            {
                "schema": "melix-fsm/controlled-acceptance/2",
                "profiles": {  # widened first in the file: the tiny figure still leads
                    "hidden256-layers4": {
                        "shape": {"hidden_size": 256, "num_hidden_layers": 4, "tokens": 96},
                        "families": {"step3p5": wide},
                    },
                    "tiny": {"families": {"step3p5": _family(0.75, 0.68), "mimo": _family(0.92, None)}},
                    "scale16-layers4": {
                        "shape": {"hidden_size": None, "num_hidden_layers": 4, "tokens": 96, "scale": 16},
                        "families": {"step3p5": _family(0.95, 0.95)},
                    },
                },
            }
        )
    )
    cells = _hook().measured_efficiency(results)
    assert cells["step3p5"] == (
        "tiny, wall clock: 0.75 (0.70-0.80) / 0.68 · "
        "h256, 4 layers, cpu clock, load 6.5: 0.97 (0.92-1.02) / 0.91 · "
        "widths x16, 4 layers, wall clock: 0.95 (0.90-1.00) / 0.95"
    )
    assert cells["mimo"] == "tiny, wall clock: 0.92 (0.87-0.97) / -"  # refused batch: no figure


def test_a_one_shape_file_reads_as_the_tiny_profile(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps({"schema": "melix-fsm/controlled-acceptance/1", "families": {"mimo": _family(0.9, 0.8)}})
    )
    assert _hook().measured_efficiency(results) == {"mimo": "tiny, wall clock: 0.90 (0.85-0.95) / 0.80"}
    assert _hook().measured_efficiency(tmp_path / "absent.json") == {}
