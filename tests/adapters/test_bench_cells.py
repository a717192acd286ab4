"""The benchmark's cell loop: runs interleaved ABBA, every side measured once per repeat.

Nothing here asserts a speed: a tiny run of the embedded checkpoint checks that each
cell records one plain / forced-on / auto sample per repeat, the auto runs' controller
data, no replay, and that the order alternates between repeats.
"""

from __future__ import annotations

import math

import pytest
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.runtime.cycle_clock import CycleClock
from melix_mlx.tools import bench as bench_module
from melix_mlx.tools.bench import Bench, _interleaved
from melix_mlx.tools.bench_results import AUTO_COUNTERS, Cell
from melix_mlx.tools.workloads import Prompt

from melix_fsm.counters import Counters
from melix_fsm.policy.cost_model import Timings, TimingTable
from melix_fsm.policy.errors import CalibrationError


def test_repeats_alternate_their_order():
    calls: list[tuple[int, str]] = []

    def runs(repeat: int) -> dict:
        return {name: (lambda n=name: calls.append((repeat, n)) or n) for name in ("plain", "mtp", "auto")}

    for repeat in range(4):
        out = _interleaved(repeat, runs(repeat))
        assert out == {"plain": "plain", "mtp": "mtp", "auto": "auto"}
    forward, backward = ["plain", "mtp", "auto"], ["auto", "mtp", "plain"]
    assert [n for r, n in calls] == forward + backward + forward + backward


def test_cells_record_every_side_once_per_repeat():
    prompts = [Prompt("code", text, "test") for text in ("def add(a, b):\n", "import os\nimport sys\n")]
    bench = Bench.open(resolve_model("stdlib-tiny"), max_tokens=6, repeats=2, prompts=prompts)
    assert bench.family == "deepseek_v3" and bench.workload_prompts == prompts  # checkpoint, caller
    # a calibration gives the table or its typed failure, recorded where the cells look
    calibration = bench.calibrate([1], [1])["1"]
    if isinstance(calibration, list):
        assert 1 in bench.timings and [e["batch_size"] for e in calibration] == [1]
    else:  # a loaded machine poisons it: typed, and auto runs disabled there
        assert isinstance(bench.failures[1], CalibrationError)
        assert calibration["error"].startswith("measurement")
    # the auto runs' prior: a fixed calibration (a measured one is poisoned on a loaded
    # machine, and what is tested here is the cells, not the timing)
    bench.timings[2] = TimingTable.of(Timings(t_1=1.0, t_verify=1.1, t_head=0.1, k=2, batch_size=2))
    for cell in (bench.batch_cell(2, 2, 0.0, deepest=True), bench.single_cell(2, 0.0, deepest=True)):
        assert len(cell.samples) == 2 and all(b > 0 and m > 0 for b, m in cell.samples)
        assert cell.auto_tps is not None and cell.auto_over_plain is not None
        assert cell.auto_depth_over_plain is not None and cell.auto_depth_k in (1, 2)
        assert cell.replay_forwards == 0 and cell.ratio_min <= cell.ratio <= cell.ratio_max
        assert len(cell.aa_ratios) == 2 and all(a > 0 for a in cell.aa_ratios)  # A/A: one per repeat
        assert cell.prompt_ratio is not None and cell.prompt_ratio > 0  # the prompt phase, side by side
        # the auto runs' policy counters, summed over both repeats' controllers
        assert set(cell.auto_counters) == set(AUTO_COUNTERS)
        assert all(type(n) is int and n >= 0 for n in cell.auto_counters.values())


def test_the_aa_control_runs_the_baseline_again_at_the_far_end_of_each_repeat():
    """The A/A ratio is the baseline's second run over its first, and the second run sits at
    the other end of the repeat from the first (so it spans every candidate's run)."""
    order: list[str] = []
    speeds = iter([100.0, 80.0, 90.0, 60.0])  # baselines in run order: plain, plain_again; reversed

    def timed(name: str):
        def run():
            order.append(name)
            return (next(speeds), 0.0) if name.startswith("plain") else (50.0, 0.0, None)

        return run

    cell = Cell("batch", 2, 1, 0.0)
    for repeat in range(2):
        out = _interleaved(repeat, {n: timed(n) for n in ("plain", "mtp", "plain_again")})
        Bench._aa(cell, out)
    assert order == ["plain", "mtp", "plain_again", "plain_again", "mtp", "plain"]
    assert cell.aa_ratios == [80.0 / 100.0, 90.0 / 60.0]
    Bench._aa(empty := Cell("batch", 2, 1, 0.0), {"plain": (100.0, 0.0), "mtp": (1.0, 0.0, None)})
    assert empty.aa_ratios == []  # not asked for: nothing recorded


def test_each_repeat_is_set_against_the_ideal_of_its_own_acceptance():
    """Single cells decode a different prompt per repeat: a repeat that accepted every
    draft and one that accepted none each ran at 0.875 of their own ideal, which is the
    efficiency; acceptance is pooled over the repeats."""
    bench = object.__new__(Bench)
    bench.timings = {1: TimingTable.of(Timings(t_1=1.0, t_verify=1.5, t_head=0.25, k=1))}  # cost 1.75
    every = Counters(cycles=10, proposed=10, accepted=10, position_proposed=[10], position_accepted=[10])
    none = Counters(cycles=10, proposed=10, rejected=10, position_proposed=[10], position_accepted=[0])
    cell = Cell("single", 1, 1, 0.0)
    cell.samples = [(100.0, 100.0), (100.0, 50.0)]  # ratios 1.0 and 0.5
    bench._finish(cell, [every.summary(), none.summary()], CycleClock())
    assert cell.acceptance_rate == 0.5 and cell.per_position_acceptance == [0.5]
    assert math.isclose(cell.efficiency, 0.875)  # 1.0 / (2 / 1.75) and 0.5 / (1 / 1.75)
    assert math.isclose(cell.ideal_ratio, (2 / 1.75 + 1 / 1.75) / 2)


def test_a_repeat_calibrated_just_before_it_is_priced_by_that_calibration():
    """With `calibrate_each_repeat` each repeat's ideal uses the cycle cost measured just
    before it; a repeat whose calibration failed (None) falls back to the cell's table,
    visibly (its entry stays None)."""
    bench = object.__new__(Bench)
    bench.timings = {1: TimingTable.of(Timings(t_1=1.0, t_verify=1.5, t_head=0.25, k=1))}  # cost 1.75
    every = Counters(cycles=10, proposed=10, accepted=10, position_proposed=[10], position_accepted=[10])
    cell = Cell("single", 1, 1, 0.0)
    cell.samples = [(100.0, 100.0), (100.0, 100.0), (100.0, 100.0)]
    cell.cycle_costs = [2.0, None, 1.5]
    bench._finish(cell, [every.summary()] * 3, CycleClock())
    assert [round(e, 6) for e in cell.efficiencies] == [1.0, 0.875, 0.75]  # 1 / (2 / cost)
    assert cell.cycle_costs == [2.0, None, 1.5]


def test_each_repeat_calibrates_at_its_cells_size_when_asked(monkeypatch):
    prompts = [Prompt("code", "def add(a, b):\n", "test")]
    bench = Bench.open(resolve_model("stdlib-tiny"), max_tokens=4, repeats=3, prompts=prompts)
    bench.timings[1] = TimingTable.of(Timings(t_1=1.0, t_verify=1.1, t_head=0.1, k=1, batch_size=1))
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(bench, "repeat_cost", lambda k, size: calls.append((k, size)) or 1.5)
    bench.aa_control = False
    bench.auto_controller = lambda *a, **kw: None
    single, batch = bench.single_cell(1, 0.0), bench.batch_cell(2, 1, 0.0)
    assert calls == [(1, 1)] * 3 + [(1, 2)] * 3
    assert single.cycle_costs == batch.cycle_costs == [1.5] * 3
    assert Bench.repeat_cost(bench, 1, 1) is None  # off unless asked: no calibration runs
    bench.calibrate_each_repeat = True
    assert Bench.repeat_cost(bench, 2, 1) is None  # k never calibrated: the cell has no ideal
    measured = Bench.repeat_cost(bench, 1, 1)  # a real calibration (None: a loaded machine poisoned it)
    assert measured is None or measured > 1.0  # a verify and a head step cost more than one forward


def test_a_failed_calibration_runs_auto_disabled_as_generate_would():
    """The bench's auto side is the controller `generate --device-policy auto` builds: a
    calibration that failed (noise poisoned it) disables it, so its cells measure what a
    user gets there (plain), with the gate saying so, instead of dropping the auto runs."""
    bench = object.__new__(Bench)
    bench.family, bench.timings = "deepseek_v3", {}
    bench.failures = {1: CalibrationError("measurement_poisoned", "t_1 samples spread 33%")}
    controller = bench.auto_controller(1, 4)
    assert controller is not None and controller.disabled and not controller.speculating
    assert bench._gate(1, 4) == "disabled"
    assert bench.auto_controller(2, 4) is None and bench._gate(2, 4) is None  # never calibrated


def test_the_single_cells_are_priced_at_batch_1_whatever_batch_sizes_were_asked(monkeypatch):
    """`bench --batch-sizes 4` still runs single-sequence cells: their ideal and their auto
    run are priced from a calibration at batch 1, not extrapolated from batch 4's."""
    seen: list[list[int]] = []

    def calibrate(self, batch_sizes, ks):
        seen.append(list(batch_sizes))
        raise RuntimeError("stop after the calibration's sizes")

    monkeypatch.setattr(Bench, "calibrate", calibrate)
    options = {"draft_dir": None, "ks": [1], "temps": [0.0], "max_tokens": 4, "repeats": 1}
    options["show_progress"] = False
    for asked, calibrated in (([4], [1, 4]), ([8, 1, 4], [1, 4, 8])):
        with pytest.raises(RuntimeError, match="stop after"):
            bench_module.run(resolve_model("stdlib-tiny"), batch_sizes=asked, **options)
        assert seen.pop() == calibrated
