"""The benchmark report renders every cell in columns that line up with its header.

Nothing here measures: the report is a pure function of `melix_mlx.tools.bench.run`'s plain
data, so the tests feed it cells built from the harness's own dataclasses.
"""

from __future__ import annotations

from dataclasses import asdict

from melix_mlx.tools.bench_report import markdown, table
from melix_mlx.tools.bench_results import Cell, DraftCell

REGIME = {
    "device": "cpu",
    "blas": "openblas",
    "blas_threads": "1",
    "machine": "x86_64",
    "dtype": "float32",
    "mlx": "0",
    "mlx_lm": "0",
}


def _results() -> dict:
    batch = Cell("batch", 4, 2, 0.0, tps=120.0, baseline_tps=100.0, ratio=1.2, ratio_min=1.1, ratio_max=1.3)
    batch.batch_fill, batch.ideal_ratio, batch.efficiency, batch.acceptance_rate = 0.84, 1.5, 0.8, 0.7
    batch.aa_ratios = [1.04, 0.91, 0.97]
    batch.prompt_ratio = 0.93
    single = Cell("single", 1, 2, 0.0, tps=50.0, baseline_tps=40.0, ratio=1.25, ratio_min=1.2, ratio_max=1.3)
    return {
        "regime": REGIME,
        "model": "m",
        "max_tokens": 64,
        "repeats": 3,
        "aa_control": True,
        "calibration": {},
        "workloads": [],
        "cells": [asdict(batch), asdict(single)],
        "draft_cells": [asdict(DraftCell(1, 0.0, tps=30.0, baseline_tps=40.0, ratio=0.75))],
    }


def test_markdown_rows_have_the_header_columns_and_fill_is_reported():
    lines = [line for line in markdown(_results()).splitlines() if line.startswith("|")]
    header, rule, batch, single, draft = lines[-5:]
    columns = header.count("|")
    assert rule.count("|") == batch.count("|") == single.count("|") == draft.count("|") == columns
    names = [c.strip() for c in header.strip("|").split("|")]
    fill = names.index("fill")
    assert batch.strip("|").split("|")[fill].strip() == "0.84"
    assert single.strip("|").split("|")[fill].strip() == "-"  # one sequence: no batch to fill


def test_text_table_reports_fill_beside_efficiency():
    lines = table(_results()).splitlines()
    header = next(line for line in lines if line.startswith("path"))
    names = header.split()
    batch = next(line for line in lines if line.startswith("batch")).split()
    assert names.index("fill") == names.index("of-ideal") + 1 and batch[names.index("fill")] == "0.84"
    assert batch[names.index("of-ideal")] == "0.80"


def test_the_report_says_whether_batch_cells_were_a_fixed_batch_or_continuous_batching():
    fixed = _results()
    queued = _results() | {"requests_per_slot": 3}
    assert "a fixed batch of B requests" in markdown(fixed) and "continuous" not in markdown(fixed)
    assert "continuous batching (3 x B requests queued, B rows at a time)" in markdown(queued)
    assert "continuous batching" in table(queued).splitlines()[0]


def test_the_aa_range_is_reported_beside_the_spread():
    lines = [line for line in markdown(_results()).splitlines() if line.startswith("|")]
    header, batch, single = lines[-5], lines[-3], lines[-2]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert names.index("A/A") == names.index("spread") + 1
    assert batch.strip("|").split("|")[names.index("A/A")].strip() == "0.91-1.04"
    assert single.strip("|").split("|")[names.index("A/A")].strip() == "-"  # not recorded: no range
    assert "A/A: mlx-lm's run repeated" in markdown(_results())
    text = table(_results()).splitlines()
    columns = next(line for line in text if line.startswith("path")).split()
    row = next(line for line in text if line.startswith("batch")).split()
    assert row[columns.index("A/A")] == "0.91-1.04"


def test_the_prompt_phase_ratio_is_a_column_of_both_tables():
    lines = [line for line in markdown(_results()).splitlines() if line.startswith("|")]
    header, batch, single = lines[-5], lines[-3], lines[-2]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert batch.strip("|").split("|")[names.index("prompt phase")].strip() == "0.93"
    assert single.strip("|").split("|")[names.index("prompt phase")].strip() == "-"  # not measured
    text = table(_results()).splitlines()
    columns = next(line for line in text if line.startswith("path")).split()
    row = next(line for line in text if line.startswith("batch")).split()
    assert row[columns.index("prompt")] == "0.93"


def _rows(text: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = text.splitlines()
    names = next(line for line in lines if line.startswith("path")).split()
    paths = ("batch", "single", "draft")
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in paths}
    return names, rows


def test_text_headers_are_readable_words_explained_by_the_legend():
    text = table(_results())
    names, rows = _rows(text)
    for cryptic in ("a/a", "eff", "adepth", "a/best", "base", "ratio"):
        assert cryptic not in names
    legend = text[text.index("legend:") :]
    for name in names[6:]:  # every measured column after the sizes and rates is explained
        assert f"{name}:" in legend or f"{name}," in legend, name
    assert all(len(row) >= len(names) for row in rows.values())  # columns line up with the header


def test_a_speedup_inside_its_aa_range_or_with_a_poisoned_calibration_is_flagged_in_place():
    results = _results()
    names, rows = _rows(table(results))
    check = names.index("check")
    assert rows["batch"][check] == "ok" and "warning" not in table(results)
    results["cells"][0]["ratio"] = 1.0  # inside its A/A range 0.91-1.04: indistinguishable from noise
    results["cells"][0]["aa_ratios"] = [0.5, 1.04]  # and the machine moved mlx-lm by itself
    names, rows = _rows(table(results))
    assert rows["batch"][check] == "noise,noisy" and rows["single"][check] == "-"
    assert "warning: 1 of 2 speedups are not trustworthy" in table(results)
    results["calibration"] = {"2": {"error": "measurement_poisoned", "detail": "spread"}}
    names, rows = _rows(table(results))
    assert rows["batch"][check] == "noise,noisy,poisoned" and rows["single"][check] == "poisoned"
    assert "warning: 2 of 2 speedups" in table(results) and "warning: 2 of 2" in markdown(results)
    lines = [line for line in markdown(results).splitlines() if line.startswith("|")]
    header, batch = lines[-5], lines[-3]
    md_names = [c.strip() for c in header.strip("|").split("|")]
    assert batch.strip("|").split("|")[md_names.index("check")].strip() == "noise,noisy,poisoned"


def test_an_aa_control_far_from_one_is_noisy_even_when_narrow():
    results = _results()
    results["cells"][0]["aa_ratios"] = [1.21, 1.36]  # mlx-lm 20-36% faster than itself: the machine moved
    names, rows = _rows(table(results))
    assert rows["batch"][names.index("check")] == "noisy"


def test_a_timed_out_calibration_is_not_called_poisoned():
    results = _results()
    results["calibration"] = {"2": {"error": "measurement_timeout", "detail": "budget"}}
    names, rows = _rows(table(results))
    assert rows["batch"][names.index("check")] == "ok"
