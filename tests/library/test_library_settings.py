"""The library's keywords resolve as the CLI's flags do, and its records are the CLI's.

`num_draft_tokens` / `device_policy` of `mtp_stream_generate`, `MTPBatchGenerator` and
`load_with_heads`: bad values are typed errors before any work; "auto" goes through the
CLI's start-up (the same receipt, calibration and controller); the calibration is reused
from the cache across calls and processes and measured again when its key changes. The
receipt and statistics are typed records whose plain data is what `generate --json`
prints and what the server's usage reads. The calibration is replaced where a verdict
matters, so nothing here depends on how busy this shared CPU is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_fsm.policy.cost_model import Timings, TimingTable  # noqa: E402
from melix_fsm.receipt import HardwareGate, Receipt  # noqa: E402
from melix_fsm.stats import GenerationStats  # noqa: E402

PROMPT = "def parse(argv):"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from melix_mlx.tools.tiny import make_tiny

    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("library") / "deepseek_v3")


@pytest.fixture(scope="module")
def loaded(tiny: Path):
    from melix_mlx.loading import load_with_heads

    return load_with_heads(tiny)


@pytest.fixture
def calibrations(monkeypatch, tmp_path):
    """A scripted calibration (cheap verify: MTP pays) with its calls counted, and an
    empty calibration cache of this test's own."""
    from melix_mlx.decoding import activation

    calls: list[dict] = []
    state = {"t_verify": 1.0e-3}

    def fake(model, head, *, batch_sizes, k, context, **kw):
        calls.append({"k": k, "batch_sizes": batch_sizes, "context": context})
        timings = [
            Timings(t_1=1e-3, t_verify=state["t_verify"], t_head=1e-4, k=k, batch_size=b) for b in batch_sizes
        ]
        return TimingTable.of(*timings)

    monkeypatch.setattr(activation, "calibrate", fake)
    monkeypatch.setenv("MELIX_FSM_CALIBRATION_CACHE", str(tmp_path / "calibration"))
    return calls, state


def _stream(loaded, **kw):
    from melix_mlx.generate import mtp_stream_generate

    model, tokenizer, head, _ = loaded
    return list(mtp_stream_generate(model, tokenizer, PROMPT, head, max_tokens=12, **kw))


BAD = [
    ({"num_draft_tokens": "fast"}, "num_draft_tokens"),
    ({"num_draft_tokens": -1}, "num_draft_tokens"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"num_draft_tokens": True}, "num_draft_tokens"),
    ({"device_policy": "maybe"}, "device_policy"),
    ({"device_policy": "auto", "controller": object()}, "device_policy"),
]


@pytest.mark.parametrize("kw, setting", BAD)
def test_bad_values_are_typed_errors_before_any_work(loaded, tiny, monkeypatch, kw, setting):
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.decoding import activation
    from melix_mlx.decoding.startup import SettingError
    from melix_mlx.loading import load_with_heads, loaders

    from melix_fsm.errors import ConfigError

    def no_work(*a, **k):
        raise AssertionError("work started before the settings were checked")

    monkeypatch.setattr(activation, "calibrate", no_work)
    monkeypatch.setattr(loaders, "load_main", no_work)
    model, _, head, _ = loaded
    with pytest.raises(SettingError) as err:
        _stream(loaded, **kw)
    assert err.value.setting == setting and isinstance(err.value, ConfigError | ValueError)
    with pytest.raises(SettingError):
        MTPBatchGenerator(model, head, **kw)
    if "controller" not in kw:
        with pytest.raises(SettingError):
            load_with_heads(tiny, **kw)


def test_a_head_without_a_receipt_needs_one_for_a_policy(tiny, loaded):
    from melix_mlx.decoding.startup import SettingError
    from melix_mlx.loading import build_head

    model, tokenizer, _, _ = loaded
    bare, _ = build_head(model, tiny)  # built by hand: no receipt attached
    with pytest.raises(SettingError, match="load_with_heads"):
        _stream((model, tokenizer, bare, None), num_draft_tokens="auto")
    # without a policy, as before: speculation at the given depth on every step
    out = _stream((model, tokenizer, bare, None), num_draft_tokens=2)
    assert out[-1].stats.cycles > 0 and out[-1].stats.policy is None


def test_load_with_heads_returns_the_receipt_and_unpacks_as_four(tiny):
    from melix_mlx.loading import Loaded, load_with_heads

    loaded = load_with_heads(tiny, num_draft_tokens="auto", device_policy="force_on")
    model, tokenizer, head, info = loaded
    assert isinstance(loaded, Loaded) and isinstance(loaded.receipt, Receipt)
    assert loaded.receipt is info.receipt
    assert loaded.receipt.num_draft_tokens == "auto" and loaded.receipt.device_policy == "force_on"
    assert loaded.receipt.source.num_draft_tokens == "explicit"
    assert json.loads(loaded.receipt.to_json()) == loaded.receipt.to_dict()
    # the settings given at load are the decoders' defaults for this head
    out = _stream(loaded)
    assert out[-1].receipt.device_policy == "force_on" and out[-1].receipt.num_draft_tokens == "auto"
    assert out[-1].stats.policy.policy == "force_on" and out[-1].stats.policy.depth == "auto"


def test_auto_runs_the_cli_start_up_and_reuses_its_calibration(loaded, calibrations):
    calls, _ = calibrations
    first = _stream(loaded, num_draft_tokens="auto")
    receipt = first[-1].receipt
    assert receipt.hardware_gate is HardwareGate.admitted and receipt.depth.mode == "auto"
    assert len(calls) == 1 and calls[0]["k"] == receipt.effective_depth  # the deepest k auto may pick
    assert first[-1].stats.policy.policy == "auto" and first[-1].stats.cycles > 0
    assert "timings reused" not in receipt.hardware.detail
    again = _stream(loaded, num_draft_tokens="auto")
    assert len(calls) == 1, "the second call measures again instead of reusing the calibration"
    assert "timings reused from" in again[-1].receipt.hardware.detail
    assert [r.token for r in again] == [r.token for r in first]  # exact either way
    # a different depth is another key: measured
    _stream(loaded, num_draft_tokens=1, device_policy="auto")
    assert len(calls) == 2 and calls[1]["k"] == 1


def test_where_mtp_loses_auto_decodes_plainly_and_the_receipt_says_why(loaded, calibrations):
    calls, state = calibrations
    state["t_verify"] = 5e-3  # a verify costs five 1-token forwards: compute-bound
    out = _stream(loaded, num_draft_tokens="auto")
    plain = _stream(loaded, device_policy="force_off")
    receipt = out[-1].receipt
    assert receipt.hardware_gate is HardwareGate.disabled and not receipt.speculates
    assert receipt.refusal_reason == "device_policy_disabled" and "disabled speculation" in receipt.message
    assert receipt.hardware.predicted_speedup < 1.0
    assert out[-1].stats.proposed == 0 and [r.token for r in out] == [r.token for r in plain]
    assert plain[-1].receipt.refusal_reason == "operator_disabled" and plain[-1].stats.cycles == 0


def test_the_calibration_key_follows_the_model_dtype_versions_and_machine(tiny, tmp_path, monkeypatch):
    from melix_mlx.decoding import calibration_cache as cc

    base = dict(dtype="float32", head="h", batch_size=1, k=2, context=32)
    key = cc.key_of(str(tiny), **base)
    assert key == cc.key_of(str(tiny), **base)
    assert key != cc.key_of(str(tiny), **{**base, "dtype": "bfloat16"})
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    assert cc.key_of(str(copy), **base)["files"] != key["files"] or cc.key_of(str(copy), **base) != key
    weights = next(copy.glob("*.safetensors"))
    before = cc.key_of(str(copy), **base)
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert cc.key_of(str(copy), **base) != before  # a rewritten weight file: measured again
    monkeypatch.setattr(cc, "versions", lambda: {"mlx": "0.0.0", "mlx-lm": "0", "melix-fsm": "0"})
    assert cc.key_of(str(tiny), **base) != key
    monkeypatch.undo()
    monkeypatch.setattr(cc, "blas_regime", lambda: "libopenblas.so.0 [OPENBLAS_NUM_THREADS=1]")
    assert cc.key_of(str(tiny), **base) != key
    # a stored record under another key is a miss, and "off" turns the cache off
    cache = cc.CalibrationCache(tmp_path / "c")
    table = TimingTable.of(Timings(t_1=1e-3, t_verify=1e-3, t_head=1e-4, k=2))
    cache.store(key, table)
    assert cache.load(key) == table
    cache.file_of(key).write_text(json.dumps({"key": {"other": 1}, "table": {}}))
    cc._MEMO.clear()
    assert cache.load(key) is None
    monkeypatch.setenv(cc.CACHE_ENV, "off")
    assert cc.default_cache() is None


def test_the_calibration_is_reused_by_another_process(tiny, loaded, calibrations, tmp_path):
    """The library measures (scripted figures) and stores; `melix-fsm generate`, in another
    process, reuses that calibration for the same model, machine and settings, and says so."""
    calls, _ = calibrations
    first = _stream(loaded, num_draft_tokens=2, device_policy="auto")
    assert len(calls) == 1 and "timings reused" not in first[-1].receipt.hardware.detail
    args = [sys.executable, "-m", "melix_fsm.cli", "generate", "--model", str(tiny), "--prompt", PROMPT]
    args += ["--max-tokens", "12", "--json", "--num-draft-tokens", "2", "--device-policy", "auto"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-2000:]
    hardware = json.loads(run.stdout)["receipt"]["hardware"]
    assert "timings reused from" in hardware["detail"], hardware["detail"]
    assert hardware["t_1"] == 1e-3 and hardware["t_head"] == 1e-4  # the scripted figures, not a measurement


def _cli_json(argv: list[str]) -> dict:
    from melix_fsm.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


# what differs between two runs of one decode: wall-clock rates and where the engine was
TIMED = {"plain_rate", "measured_speedup", "predicted_speedup", "rates_per_k", "source", "ema_acceptance"}


def _untimed(stats: dict) -> dict:
    policy = stats.get("policy")
    if policy is not None:
        stats = {**stats, "policy": {k: v for k, v in policy.items() if k not in TIMED}}
    return stats


def test_library_cli_and_server_usage_agree(tiny, loaded, calibrations):
    """One decode three ways: the library's records, `generate --json`, the server's usage."""
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.serve.usage import speculative_usage

    from melix_fsm.stats import STATS_SCHEMA_ID

    argv = ["generate", "--model", str(tiny), "--prompt", PROMPT, "--max-tokens", "12", "--json"]
    cli = _cli_json([*argv, "--num-draft-tokens", "2", "--device-policy", "force_on"])
    lib = _stream(loaded, num_draft_tokens=2, device_policy="force_on")
    stats, receipt = lib[-1].stats, lib[-1].receipt
    assert cli["stats"]["schema"] == STATS_SCHEMA_ID
    assert GenerationStats.of(cli["stats"]).to_dict() == cli["stats"]  # the CLI prints the record's data
    assert _untimed(cli["stats"]) == _untimed(stats.to_dict())
    assert cli["tokens"] == [r.token for r in lib if r.finish_reason != "stop"]
    want = {**receipt.to_dict(), "model": cli["receipt"]["model"]}
    assert cli["receipt"] == want  # the same receipt, hardware gate included
    # the server's usage reads the batch generator's record of the same kind
    model, tokenizer, head, _ = loaded
    gen = MTPBatchGenerator(model, head, num_draft_tokens=2, device_policy="force_on", max_tokens=12)
    gen.insert([tokenizer.encode(PROMPT)])
    final = None
    while final is None:
        final = next((r for r in gen.next_generated() if r.finish_reason), None)
    gen.close()
    assert isinstance(final.stats, GenerationStats) and gen.receipt.batched
    usage = speculative_usage(final.stats)
    for name in ("proposed", "accepted", "rejected", "cycles", "suspended_steps", "position_proposed"):
        assert usage[name] == final.stats[name] == getattr(final.stats, name)
    assert usage["acceptance_rate"] == final.stats.acceptance_rate and usage["method"] == "mtp"
    # one row, greedy, forced on: the batch speculates as the stream did
    assert final.stats.accepted == stats.accepted and final.stats.cycles == stats.cycles


def test_the_records_match_their_committed_schemas():
    from melix_fsm import stats
    from melix_fsm.receipt import schema_json, schema_path

    assert stats.schema_path().read_bytes() == stats.schema_json(), "regenerate spec/stats.schema.json"
    assert schema_path().read_bytes() == schema_json()


def test_the_decoders_keys_are_the_records_fields(loaded):
    """Nothing a decoder reports is dropped by the typed record, and nothing is invented."""
    import mlx.core as mx
    from melix_mlx.decoding.generate import make_decoder

    from melix_fsm.policy.controller import LiveController
    from melix_fsm.policy.cost_model import acceptance_prior
    from melix_fsm.stats import PolicyStats

    model, _, head, _ = loaded
    ctrl = LiveController(None, prior=acceptance_prior(None), policy="force_on", depth=2, max_depth=2)
    decoder = make_decoder(model, head, num_draft_tokens=2, controller=ctrl)
    list(decoder.generate(mx.array([5, 6, 7]), 4))
    data = decoder.stats
    assert set(data) == set(GenerationStats.__struct_fields__) - {"schema"}
    assert set(data["policy"]) == set(PolicyStats.__struct_fields__)


def test_a_failed_calibration_is_kept_a_while_in_one_process(loaded, calibrations, monkeypatch):
    """A busy machine fails the measurement: later calls decode plainly at once, saying why,
    instead of spending the budget again; after FAILURE_RETRY_S it is measured again."""
    from melix_mlx.decoding import activation, calibration_cache

    from melix_fsm.policy.errors import CalibrationError

    calls = []

    def failing(*a, **kw):
        calls.append(1)
        return CalibrationError("measurement_timeout", "30.3 s spent, budget 30 s")

    monkeypatch.setattr(activation, "calibrate", failing)
    for _ in range(2):
        out = _stream(loaded, num_draft_tokens=3, device_policy="auto")
        assert out[-1].receipt.refusal_reason == "device_policy_disabled" and out[-1].stats.proposed == 0
        assert "measurement_timeout" in out[-1].receipt.message
    assert len(calls) == 1
    assert not list(calibration_cache.cache_root().glob("*.json"))  # never stored on disk
    monkeypatch.setattr(calibration_cache, "FAILURE_RETRY_S", 0.0)
    _stream(loaded, num_draft_tokens=3, device_policy="auto")
    assert len(calls) == 2


def test_settings_given_at_load_are_defaults_a_call_overrides(tiny):
    from melix_mlx.loading import load_with_heads

    loaded = load_with_heads(tiny, device_policy="force_off")
    assert loaded.receipt.refusal_reason == "operator_disabled"  # what the settings resolve to
    off = _stream(loaded)
    assert off[-1].receipt.refusal_reason == "operator_disabled" and off[-1].stats.cycles == 0
    on = _stream(loaded, num_draft_tokens=2, device_policy="force_on")
    assert on[-1].receipt.speculates and on[-1].stats.cycles > 0
    assert [r.token for r in on] == [r.token for r in off]


def test_the_server_reuses_a_stored_calibration(tiny, loaded, calibrations):
    """`melix-fsm serve` starts through the same cache: a calibration the library stored
    for this model, batch size and depth is reused, and the served receipt says so."""
    from melix_mlx.serve.provider import load_served_model

    calls, _ = calibrations
    first = load_served_model(str(tiny), 2, "auto")
    assert len(calls) == 1 and "timings reused" not in first.receipt["hardware"]["detail"]
    again = load_served_model(str(tiny), 2, "auto")
    assert len(calls) == 1, "a restarted server measured again instead of reusing its calibration"
    assert "timings reused from" in again.receipt["hardware"]["detail"]


def test_the_blas_in_the_key_is_the_one_mlx_uses():
    """A process that imported numpy (its vendored OpenBLAS mapped) keys its calibration as
    one that did not: only a BLAS serving mlx's matmuls (the wheel's, or a preloaded one)
    changes the key."""
    from melix_mlx.decoding import calibration_cache as cc

    def maps(*paths: str) -> str:
        return "".join(f"7f{i:04x}-7f{i + 1:04x} r-xp 00000000 fe:00 {i} {p}\n" for i, p in enumerate(paths))

    wheel = "/v/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
    numpy_copy = "/v/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
    preloaded = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert cc.blas_regime(maps(wheel, numpy_copy)) == cc.blas_regime(maps(wheel))
    assert cc.blas_regime(maps(wheel, preloaded)) != cc.blas_regime(maps(wheel))
