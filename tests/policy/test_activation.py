"""activation.evaluate on a tiny checkpoint: receipt, controller and decoder agree (needs mlx).

The calibration is replaced where a verdict matters, so nothing depends on how busy this
shared CPU is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_fsm.config import speculative_config  # noqa: E402
from melix_fsm.policy.cost_model import Timings, TimingTable
from melix_fsm.policy.decision import Reason
from melix_fsm.policy.errors import CalibrationError
from melix_fsm.reasons import RefusalReason  # noqa: E402
from melix_fsm.receipt import HardwareGate, Mode, resolve  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from melix_mlx.tools.tiny import make_tiny

    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("activation") / "deepseek_v3")


@pytest.fixture(scope="module")
def loaded(tiny: Path):
    from melix_mlx.loading import load_with_heads

    return load_with_heads(tiny)


def _decode(loaded, controller, max_tokens: int = 16) -> dict:
    from melix_mlx.generate import mtp_stream_generate

    model, tokenizer, head, _ = loaded
    responses = list(
        mtp_stream_generate(
            model, tokenizer, "def parse(argv):", head, max_tokens=max_tokens, controller=controller
        )
    )
    return responses[-1].stats


@pytest.mark.parametrize("reason", ["measurement_failed", "measurement_timeout", "measurement_poisoned"])
def test_failed_calibration_disables_receipt_stats_and_decoder_alike(tiny, loaded, monkeypatch, reason):
    from melix_mlx.decoding import activation

    monkeypatch.setattr(activation, "calibrate", lambda *a, **kw: CalibrationError(reason, "two CPU hogs"))
    model, _, head, _ = loaded
    config = speculative_config()
    receipt = resolve(tiny, config)
    assert receipt.mode is Mode.accepted
    act = activation.evaluate(model, head, receipt, config)
    # the receipt
    assert act.receipt.refusal_reason is RefusalReason.device_policy_disabled
    assert act.receipt.hardware_gate is HardwareGate.disabled and act.decision.reason is Reason(reason)
    assert f"disabled speculation for this run: {reason}" in act.receipt.message
    # the controller: there is one, and it is off for good
    assert act.controller is not None and act.controller.disabled and not act.controller.speculating
    # the decoder, handed that controller, drafts nothing
    stats = _decode(loaded, act.controller)
    assert stats["proposed"] == 0 and stats["cycles"] == 0
    assert stats["policy"]["state"] == "disabled" and stats["policy"]["disabled_reason"] == reason
    assert stats["policy"]["speculating"] is False


def _table(t_verify: float, k: int) -> TimingTable:
    return TimingTable.of(Timings(t_1=1e-3, t_verify=t_verify, t_head=1e-4, k=k, batch_size=1))


@pytest.mark.parametrize("t_verify, admitted", [(1.0e-3, True), (5e-3, False)])
def test_gate_and_controller_start_in_the_same_state(tiny, loaded, monkeypatch, t_verify, admitted):
    from melix_mlx.decoding import activation

    monkeypatch.setattr(activation, "calibrate", lambda *a, k, **kw: _table(t_verify, k))
    model, _, head, _ = loaded
    config = speculative_config(num_draft_tokens=2)
    act = activation.evaluate(model, head, resolve(tiny, config), config)
    assert act.decision.speculate is admitted and act.controller.speculating is admitted
    assert (act.receipt.mode is Mode.accepted) is admitted
    if not admitted:  # a measured prior: the live controller may still resume it
        assert (
            "disabled speculation at start" in act.receipt.message
            and act.receipt.lifecycle_state == "suspended"
        )
    assert act.receipt.depth is not None and act.receipt.depth.mode == "fixed" and act.k == 2


def test_auto_depth_is_in_the_receipt_and_the_controller(tiny, loaded, monkeypatch):
    from melix_mlx.decoding import activation

    calls = []

    def fake(*a, k, **kw):
        calls.append(k)
        return _table(1.0e-3, k)

    monkeypatch.setattr(activation, "calibrate", fake)
    model, _, head, _ = loaded
    config = speculative_config(num_draft_tokens="auto")
    receipt = resolve(tiny, config)
    assert receipt.num_draft_tokens == "auto" and receipt.effective_depth >= 1
    act = activation.evaluate(model, head, receipt, config)
    assert calls == [receipt.effective_depth]  # calibrated at the deepest depth auto may pick
    depth = act.receipt.depth
    assert depth is not None and depth.mode == "auto" and depth.max_k == receipt.effective_depth
    assert act.k == depth.k == act.controller.k and 1 <= act.k <= depth.max_k
    assert act.decision.k == act.k  # the gate priced the depth the run starts with


def test_force_policies_build_forced_controllers(tiny, loaded):
    from melix_mlx.decoding import activation

    model, _, head, _ = loaded
    config = speculative_config(device_policy="force_on")
    act = activation.evaluate(model, head, resolve(tiny, config), config)
    assert act.controller.speculating and act.controller.state == "force_on"
    assert act.receipt.hardware.operator_override


def test_real_calibration_keeps_receipt_and_controller_consistent(tiny, loaded):
    """Whatever this CPU measures (or fails to), the receipt and the controller agree."""
    from melix_mlx.decoding import activation

    model, _, head, _ = loaded
    config = speculative_config()
    act = activation.evaluate(model, head, resolve(tiny, config), config, budget_s=20.0)
    assert act.controller.speculating is act.decision.speculate
    assert (act.receipt.hardware_gate is HardwareGate.admitted) is act.controller.speculating
    if act.receipt.hardware_gate is HardwareGate.disabled and act.decision.reason.value.startswith(
        "measurement"
    ):
        assert act.controller.disabled


def test_replay_is_priced_only_where_the_engine_replays(loaded, tmp_path):
    from melix_mlx.decoding.activation import replays_on_reject
    from melix_mlx.loading import load_with_heads
    from melix_mlx.tools.tiny import make_tiny

    model = loaded[0]
    assert replays_on_reject(model) is False  # attention only: KV caches trim
    hybrid = load_with_heads(make_tiny("qwen3_5", tmp_path / "qwen3_5"))[0]
    assert replays_on_reject(hybrid) is False  # gated-delta layers are captured in the verify


@pytest.mark.parametrize("context, timed_at", [(None, 16), (700, 700), (10, 16), (10**6, 2048)])
def test_calibration_is_priced_at_the_runs_context(tiny, loaded, monkeypatch, context, timed_at):
    """Attention grows with the cache: the prior times the forwards at the context the run
    will hold (bounded: calibration prefills it once per row), a short prompt by default."""
    from melix_mlx.decoding import activation

    seen = []

    def fake(*a, k, context, **kw):
        seen.append(context)
        return _table(1.0e-3, k)

    monkeypatch.setattr(activation, "calibrate", fake)
    model, _, head, _ = loaded
    config = speculative_config()
    activation.evaluate(model, head, resolve(tiny, config), config, context=context)
    assert seen == [timed_at]
