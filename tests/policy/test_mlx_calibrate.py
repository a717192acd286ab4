"""The mlx glue and the `calibrate` CLI on a tiny checkpoint (skipped without mlx).

Timings here are real but irrelevant: assertions check shapes, cache bookkeeping, the
plumbing into `decide`, and exit statuses, never which verdict a shared CPU produces.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_fsm.cli import main  # noqa: E402
from melix_fsm.policy.cost_model import TimingTable
from melix_fsm.policy.errors import CalibrationError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from melix_mlx.tools.tiny import make_tiny

    return make_tiny("qwen3_5", tmp_path_factory.mktemp("calib") / "qwen3_5")


@pytest.fixture(scope="module")
def loaded(tiny: Path):
    from melix_mlx.loading import load_with_heads

    return load_with_heads(tiny)


def _lengths(cache) -> list:
    from melix_mlx.runtime import rollback

    return [c.offset if hasattr(c, "offset") else [id(a) for a in c.cache] for c in rollback.leaves(cache)]


def test_timed_forwards_leave_cache_lengths_fixed(loaded):
    from melix_mlx.runtime.calibrate import build_forwards
    from mlx_lm.models.cache import make_prompt_cache

    model, _, head, _ = loaded
    cache, head_cache = make_prompt_cache(model), head.make_cache()
    fns = build_forwards(model, head, batch_size=2, k=2, cache=cache, head_cache=head_cache)
    before, head_before = _lengths(cache), head_cache[0].offset
    assert head_before == 15  # primed from the 16-token prompt's (hidden, next) pairs
    for _ in range(3):
        for fn in fns:
            fn()
    assert _lengths(cache) == before and head_cache[0].offset == head_before


def test_timed_forwards_are_fed_distinct_ids_the_same_every_time(loaded, monkeypatch):
    """A MoE routes each token to its own experts: the timed forwards read distinct ids in
    every row and position (one repeated id priced a 64-expert batch-4 verify 31 % low), in the
    vocabulary, and the same ids on every build (ranks and runs time the same forwards);
    stored calibrations timed otherwise are not reused (the cache key names the inputs)."""
    from melix_mlx.decoding.calibration_cache import key_of
    from melix_mlx.runtime import calibrate as glue
    from melix_mlx.runtime.hidden import main_parts

    model, _, head, _ = loaded
    fed: list[list[list[int]]] = []
    real = glue.forward_with_hidden
    monkeypatch.setattr(glue, "forward_with_hidden", lambda m, x, c: fed.append(x.tolist()) or real(m, x, c))
    builds = []
    for _ in range(2):
        fed.clear()
        fn_1, fn_verify, _ = glue.build_forwards(model, head, batch_size=2, k=2)
        fn_1(), fn_verify()
        builds.append(list(fed))
    prompt, step, verify = builds[0]
    assert builds[0] == builds[1]
    vocab = main_parts(model).embed_tokens.weight.shape[0]
    for tokens, width in ((prompt, 16), (step, 1), (verify, 3)):
        assert len(tokens) == 2 and all(len(row) == width for row in tokens)
        assert all(0 < t < vocab for row in tokens for t in row)
        assert tokens[0] != tokens[1]  # the rows differ, as a batch's do
    assert all(len(set(row)) > 1 for row in prompt + verify)  # positions differ
    assert key_of("/nonexistent", dtype="float32", head="mtp", batch_size=1, k=2, context=16)["forwards"]


class _Ticker:
    """Every read advances 1 ms: each forward then takes exactly 1 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def test_calibrate_builds_a_table(loaded):
    from melix_mlx.runtime.calibrate import calibrate

    model, _, head, _ = loaded
    table = calibrate(model, head, batch_sizes=(1, 2), k=1, runs=2, warmup=1, timer=_Ticker())
    assert isinstance(table, TimingTable)
    assert [t.batch_size for t in table.entries] == [1, 2]
    assert all(t.t_1 == pytest.approx(1e-3) and t.k == 1 and t.runs == 2 for t in table.entries)


def test_calibrate_budget_is_a_typed_timeout(loaded):
    from melix_mlx.runtime.calibrate import calibrate

    model, _, head, _ = loaded
    result = calibrate(model, head, batch_sizes=(1,), k=1, runs=50, warmup=0, budget_s=0.01, timer=_Ticker())
    assert isinstance(result, CalibrationError) and result.reason == "measurement_timeout"


def test_agree_is_identity_in_one_process():
    from melix_mlx.runtime.calibrate import agree

    class Solo:
        def size(self) -> int:
            return 1

    failure = CalibrationError("measurement_failed")
    assert agree(failure) is failure and agree(failure, Solo()) is failure


def test_cli_json(tiny: Path, capsysbinary):
    status = main(
        ["calibrate", "--model", str(tiny), "--batch-size", "1", "2", "--runs", "2", "--warmup", "1"]
        + ["--max-spread", "100", "--json"]
    )
    out = json.loads(capsysbinary.readouterr().out)
    assert status == 0
    assert out["family"] == "qwen3_5" and out["policy"] == "auto"
    assert [d["batch_size"] for d in out["decisions"]] == [1, 2]
    d = out["decision"]
    assert d["hardware_gate"] in ("admitted", "disabled") and d["hardware_policy"] == "auto"
    assert d["t_1"] > 0 and d["predicted_speedup"] > 0 and d["prior"]["name"] == "qwen3_5"
    assert d["hardware"]["platform"] in ("linux_cpu", "apple_gpu", "apple_cpu", "cuda", "other")
    assert out["clashes"] == []  # tolerance --max-spread 100: no pair can clash


def test_cli_defaults_to_the_embedded_checkpoint(capsysbinary):
    status = main(["calibrate", "--runs", "2", "--warmup", "0", "--max-spread", "100", "--json"])
    out = json.loads(capsysbinary.readouterr().out)
    assert status == 0 and out["family"] == "deepseek_v3" and out["model"].endswith("stdlib-tiny")


def test_cli_reports_batch_sizes_that_clash(tiny: Path, monkeypatch, capsysbinary):
    import melix_fsm.policy.calibration as calibration
    from melix_fsm.policy.cost_model import Timings

    def measured(*forwards, k, batch_size, **kw):  # B=1 ran in a slow window
        t_1 = 0.030 if batch_size == 1 else 0.010
        return Timings(t_1=t_1, t_verify=1.3 * t_1, t_head=0.1 * t_1, k=k, batch_size=batch_size)

    monkeypatch.setattr(calibration, "measure", measured)
    status = main(["calibrate", "--model", str(tiny), "--batch-size", "1", "2", "--json"])
    captured = capsysbinary.readouterr()
    out = json.loads(captured.out)
    assert status == 3 and len(out["clashes"]) == 2  # t_1 and t_verify
    assert out["clashes"][0].startswith("t_1 at B=1 (30.00 ms) above B=2 (10.00 ms)")
    assert b"measurement_poisoned: t_1 at B=1" in captured.err


def test_cli_text_and_override(tiny: Path, capsys):
    status = main(["calibrate", "--model", str(tiny), "--runs", "2", "--max-spread", "100"])
    status_off = main(
        ["calibrate", "--model", str(tiny), "--runs", "2", "--max-spread", "100"]
        + ["--device-policy", "force_off"]
    )
    out = capsys.readouterr().out
    assert status == status_off == 0
    assert "t_verify ms" in out and "disabled (operator_forced_off)" in out


def test_cli_refusals(tiny: Path, tmp_path: Path, capsys):
    from melix_mlx.tools.tiny import make_tiny

    assert main(["calibrate", "--model", str(tmp_path / "absent")]) == 2
    headless = make_tiny("qwen3_5", tmp_path / "headless", head_in_sidecar=True)
    (headless / "mtp.safetensors").unlink()
    assert main(["calibrate", "--model", str(headless)]) == 3
    assert "missing_head_weights" in capsys.readouterr().err


def test_calibrate_measures_a_slow_window_again_at_each_size_s_own_context(loaded, monkeypatch):
    """The glue: contexts per batch size reach the forwards, and a batch size whose first
    measurement contradicts a larger one is measured again (a fake clock: B=1's first
    forwards take 30 ms, its second 10 ms; B=2's take 12 ms)."""
    import melix_mlx.runtime.calibrate as glue

    clock = _Ticker()
    built: list[tuple[int, int]] = []
    durations = {1: [30e-3, 10e-3], 2: [12e-3, 12e-3]}

    def fake_forwards(model, head, *, batch_size, k, prompt_len):
        built.append((batch_size, prompt_len))
        ms = durations[batch_size].pop(0)

        def forward() -> None:
            clock.now += ms

        return forward, forward, forward

    monkeypatch.setattr(glue, "build_forwards", fake_forwards)
    model, _, head, _ = loaded
    contexts = {1: 40, 2: 56}
    table = glue.calibrate(
        model, head, batch_sizes=(1, 2), k=1, runs=3, warmup=0, timer=clock, context=contexts
    )
    assert isinstance(table, TimingTable)
    assert built == [(1, 40), (2, 56), (1, 40), (2, 56)]
    assert [round(t.t_1, 4) for t in table.entries] == [0.011, 0.013]  # + the ticker's 1 ms read
    assert all("t_1 at B=1" in t.remeasured for t in table.entries)
