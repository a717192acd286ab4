"""The benchmark's cell loop: runs interleaved ABBA, every side measured once per repeat.

Nothing here asserts a speed: a tiny run of the embedded checkpoint checks that each
cell records one plain / forced-on / auto sample per repeat, the auto runs' controller
data, no replay, and that the order alternates between repeats.
"""

from __future__ import annotations

from melix_mlx.bench import Bench, _interleaved
from melix_mlx.checkpoints import resolve_model
from melix_mlx.loading import load_with_heads
from melix_mlx.workloads import Prompt


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
    model_dir = resolve_model("stdlib-tiny")
    model, tokenizer, head, info = load_with_heads(model_dir)
    bench = Bench(
        model,
        tokenizer,
        head,
        family=info.family,
        max_tokens=6,
        repeats=2,
        prompts=[Prompt("code", text, "test") for text in ("def add(a, b):\n", "import os\nimport sys\n")],
    )
    calibration = bench.calibrate([2], [2])
    assert isinstance(calibration["2"], list)  # calibrated: the auto runs have their prior
    for cell in (bench.batch_cell(2, 2, 0.0, deepest=True), bench.single_cell(2, 0.0, deepest=True)):
        assert len(cell.samples) == 2 and all(b > 0 and m > 0 for b, m in cell.samples)
        assert cell.auto_tps is not None and cell.auto_over_plain is not None
        assert cell.auto_depth_over_plain is not None and cell.auto_depth_k in (1, 2)
        assert cell.replay_forwards == 0 and cell.ratio_min <= cell.ratio <= cell.ratio_max
