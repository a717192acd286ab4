"""What the mlx commands print and where they write: generate's summary line, the bench's
output directory, calibrate's progress.

Rules of this file:
- Runs that must speculate pass `--device-policy force_on` (no seconds-long measurement).
- Nothing asserts a timing: only the shape of the lines.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import pytest
from melix_mlx.commands.generate_summary import summary

from melix_fsm.cli import main

FORCE_ON = ("--device-policy", "force_on")
RECEIPT_PREFIX = "melix-fsm generate: receipt: "
SUMMARY = re.compile(
    r"^melix-fsm generate: mtp k=1: \d+ tokens, [\d.]+ tok/s, acceptance [\d.]+ \(\d+/\d+ drafts\)"
)


def test_generate_prints_a_one_line_summary_not_the_receipt(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "stdlib-tiny", "--prompt", "def add(a, b):", "--max-tokens", "8"]
    assert main([*argv, *FORCE_ON]) == 0
    err = capsys.readouterr().err
    assert RECEIPT_PREFIX not in err
    line = err.splitlines()[-1]
    assert SUMMARY.match(line), line
    assert len(line) < 200
    assert main([*argv, *FORCE_ON, "--receipt"]) == 0  # asked for: the full receipt too
    err = capsys.readouterr().err
    receipt = json.loads(
        next(x for x in err.splitlines() if x.startswith(RECEIPT_PREFIX))[len(RECEIPT_PREFIX) :]
    )
    assert receipt["mode"] == "accepted" and SUMMARY.match(err.splitlines()[-1])


def test_json_output_is_unchanged_and_has_no_summary(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "stdlib-tiny", "--prompt", "x = 1", "--max-tokens", "4", "--json"]
    assert main([*argv, *FORCE_ON]) == 0
    out, err = capsys.readouterr()
    [result] = [json.loads(line) for line in out.splitlines()]
    assert result["receipt"]["mode"] == "accepted" and result["method"] == "mtp"
    assert "tok/s" not in err and RECEIPT_PREFIX not in err


def test_a_batched_run_summarises_every_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nclass A:\n")
    argv = ["generate", "--model", "stdlib-tiny", "--prompts-file", str(prompts), "--max-tokens", "4"]
    assert main([*argv, *FORCE_ON]) == 0
    line = capsys.readouterr().err.splitlines()[-1]
    assert re.match(
        r"^melix-fsm generate: mtp k=1: 2 prompts, \d+ tokens in [\d.]+ s \([\d.]+ tok/s\)", line
    ), line


def _common(method: str = "mtp", k: object = 2, receipt: dict | None = None) -> dict:
    return {"method": method, "num_draft_tokens": k, "depth": 3, "receipt": receipt or {}}


def test_summary_prefers_the_measured_speedup_then_the_prediction() -> None:
    stats = {"accepted": 3, "proposed": 4, "policy": {"measured_speedup": 1.4}}
    result = {"tokens": [1] * 7, "generation_tps": 50.0, "stats": stats}
    predicted = {"hardware": {"predicted_speedup": 1.25}}
    line = summary("p", [result], _common(receipt=predicted), None)
    assert line == "p: mtp k=2: 7 tokens, 50.0 tok/s, acceptance 0.75 (3/4 drafts), 1.40x plain (measured)"
    result["stats"] = {"accepted": 3, "proposed": 4}
    assert line.replace("1.40x plain (measured)", "1.25x plain (predicted)") == summary(
        "p", [result], _common(receipt=predicted), None
    )
    assert summary("p", [result], _common(k="auto"), None).startswith("p: mtp k=auto (ended at k=3): ")
    assert summary("p", [result], _common(), None).endswith("(3/4 drafts)")  # no estimate: none shown


def test_summary_says_when_the_policy_never_drafted() -> None:
    result = {"tokens": [1, 2, 3], "generation_tps": 9.0, "stats": {"accepted": 0, "proposed": 0}}
    line = summary("p", [result], _common(k=1), None)
    assert line == "p: mtp k=1: 3 tokens, 9.0 tok/s, no drafts (the device policy decoded plainly)"
    result["stats"]["policy"] = {"prompt_acceptance": 0.312}  # a sampled start its prompt priced off
    line = summary("p", [result], _common(k=1), None)
    why = "the prompt's sampled acceptance 0.31 does not pay"
    assert line.endswith(f"no drafts (the device policy decoded plainly: {why})")


def test_summary_of_a_plain_decode_says_why() -> None:
    result = {"tokens": [1, 2], "generation_tps": 10.0, "stats": {"refusal_reason": "unsupported_model"}}
    refused = {"refusal_reason": "unsupported_model"}
    line = summary("p", [result], _common(method="none", receipt=refused), None)
    assert line == "p: plain decode (unsupported_model): 2 tokens, 10.0 tok/s"


@pytest.fixture
def plot_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's extra seen as installed: these runs stop before the plot."""
    if importlib.util.find_spec("matplotlib") is None:
        fake = types.ModuleType("matplotlib")
        fake.__spec__ = importlib.machinery.ModuleSpec("matplotlib", None)
        monkeypatch.setitem(sys.modules, "matplotlib", fake)


@pytest.mark.usefixtures("plot_extra")
def test_bench_writes_to_the_cache_directory_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import melix_mlx.tools.bench
    from melix_mlx.loading.errors import HeadLoadError

    def refuse(*args: object, **kwargs: object) -> dict:
        raise HeadLoadError("stopped before measuring")

    monkeypatch.setattr(melix_mlx.tools.bench, "run", refuse)
    monkeypatch.setenv("MELIX_FSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--batch-sizes", "1", "--no-progress"]) == 3
    capsys.readouterr()
    assert (tmp_path / "cache" / "bench").is_dir() and not (tmp_path / "bench-results").exists()
    assert main(["bench", "--batch-sizes", "1", "--no-progress", "--out", str(tmp_path / "mine")]) == 3
    assert (tmp_path / "mine").is_dir()


@pytest.mark.usefixtures("plot_extra")
def test_bench_takes_embedded_names_and_refuses_unknown_ones_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import melix_mlx.tools.bench
    from melix_mlx.loading.checkpoints import resolve_model
    from melix_mlx.loading.errors import HeadLoadError

    seen: dict = {}

    def record(model_dir: Path, **kwargs: object) -> dict:
        seen.update(model=model_dir, draft=kwargs["draft_dir"])
        raise HeadLoadError("stopped before measuring")

    monkeypatch.setattr(melix_mlx.tools.bench, "run", record)
    out = ["--out", str(tmp_path / "out"), "--no-progress"]
    assert main(["bench", "--model", "stdlib-hybrid", "--draft-model", "stdlib-tiny-draft", *out]) == 3
    assert seen == {"model": resolve_model("stdlib-hybrid"), "draft": resolve_model("stdlib-tiny-draft")}
    capsys.readouterr()
    seen.clear()
    assert main(["bench", "--draft-model", "no-such-draft", *out]) == 2
    assert "--draft-model no-such-draft: no such directory" in capsys.readouterr().err and seen == {}


def test_calibrate_shows_progress_as_plain_lines_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["calibrate", "--model", "stdlib-tiny", "--runs", "3", "--warmup", "0", "--json"]
    main(argv)  # 0 or 3 (a noisy machine may poison the samples): progress either way
    out, err = capsys.readouterr()
    assert json.loads(out)["model"].endswith("stdlib-tiny")
    lines = [line for line in err.splitlines() if line.startswith("calibrate: ")]
    assert lines == ["calibrate: loading the model", "calibrate: timing B=1", "calibrate: 1/1"]
    assert "\r" not in err
    main([*argv, "--no-progress"])  # no progress line (a poisoned run's error line may still name it)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("calibrate: ")]


@pytest.mark.usefixtures("plot_extra")
def test_a_failed_regime_run_is_an_exit_status_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    from melix_mlx.commands import bench as bench_command

    def child_refused(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(argv, 3)  # the child printed its refusal and exited 3

    monkeypatch.setattr(bench_command.subprocess, "run", child_refused)
    argv = ["bench", "--regime", "reference", "--batch-sizes", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "the reference run failed (exit 3)" in err and "Traceback" not in err
