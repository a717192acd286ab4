"""The benchmark report renders every cell in columns that line up with its header.

Nothing here measures: the report is a pure function of `melix_mlx.bench.run`'s plain
data, so the tests feed it cells built from the harness's own dataclasses.
"""

from __future__ import annotations

from dataclasses import asdict

from melix_mlx.bench_report import markdown, table
from melix_mlx.bench_results import Cell, DraftCell

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
    assert names.index("fill") == names.index("eff") + 1 and batch[names.index("fill")] == "0.84"
    assert batch[names.index("eff")] == "0.80"


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
    assert row[columns.index("a/a")] == "0.91-1.04"


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
