"""CLI: make-tiny, generate (single, batched, fallback, method none) and convert.

Commands run in-process through `melix_fsm.cli.main` (mlx is already imported by the
test session); outputs are compared with mlx-lm's own greedy generation. Runs that must
speculate pass `--device-policy force_on`: under `auto` the measured device policy may
(rightly, on this CPU) keep speculation off, and its measurement takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import melix_mlx.commands.generate as generate_cmd
import mlx.core as mx
import pytest
from melix_mlx.loading import load_with_heads
from mlx_lm.generate import generate_step

from melix_fsm.cli import main

MAX = 12


FORCE_ON = ("--device-policy", "force_on")


def run_json(capsys, *argv: str) -> tuple[int, list[dict], str]:
    status = main(list(argv))
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines() if line.strip()]
    return status, lines, out.err


def greedy(path: Path, prompt: str, n: int = MAX) -> list[int]:
    """mlx-lm's greedy ids for `prompt`, cut before the first EOS (as `generate` prints)."""
    model, tokenizer, _, _ = load_with_heads(path)
    ids = tokenizer.encode(prompt)
    out = []
    for t, _ in generate_step(mx.array(ids), model, max_tokens=n):
        if t in tokenizer.eos_token_ids:
            break
        out.append(t)
    return out


def test_make_tiny_then_generate_json(tmp_path, capsys) -> None:
    target = tmp_path / "tiny-mimo"
    assert main(["make-tiny", "mimo", str(target), "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    status, [result], _ = run_json(
        capsys, "generate", "--model", str(target), "--prompt", "Hi there", "--json",
        "--max-tokens", str(MAX), "--temp", "0", "--num-draft-tokens", "2", *FORCE_ON,
    )  # fmt: skip
    assert status == 0
    assert result["tokens"] == greedy(target, "Hi there")
    assert result["method"] == "mtp" and result["model_source"] == "explicit"
    assert result["receipt"]["mode"] == "accepted", result["receipt"]["message"]
    assert result["receipt"]["family"] == "mimo"
    stats = result["stats"]
    assert stats["cycles"] > 0 and stats["target_forwards"] > 0
    assert {"accepted", "rejected", "per_position_acceptance"} <= set(stats)
    assert len(stats["per_position_acceptance"]) == 2


def test_generate_plain_text_output(tiny_dirs, capsys) -> None:
    argv = ["generate", "--model", str(tiny_dirs["mimo"]), "--prompt", "Hi", "--max-tokens", "5", *FORCE_ON]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.lstrip().startswith("{")


def test_prompts_file_batched_equals_single(tiny_dirs, tmp_path, capsys) -> None:
    path = tiny_dirs["qwen3_5"]  # hybrid caches: the hardest batch rollback
    prompts = ["The cat", "A much longer prompt than the others", "x"]
    file = tmp_path / "prompts.json"
    file.write_text(json.dumps(prompts))
    status, results, _ = run_json(
        capsys, "generate", "--model", str(path), "--prompts-file", str(file), "--json",
        "--max-tokens", str(MAX), "--num-draft-tokens", "2", "--stagger", "2", *FORCE_ON,
    )  # fmt: skip
    assert status == 0 and [r["index"] for r in results] == [0, 1, 2]
    for prompt, result in zip(prompts, results):
        assert result["prompt"] == prompt
        assert result["tokens"] == greedy(path, prompt), prompt
        assert result["stats"] is not None and result["finish_reason"] in ("length", "stop")
        assert result["stats"]["cycles"] > 0


def test_prompts_file_lines_and_method_none(tiny_dirs, tmp_path, capsys) -> None:
    path = tiny_dirs["mimo"]
    file = tmp_path / "prompts.txt"
    file.write_text("first prompt\n\nsecond one\n")
    status, results, _ = run_json(
        capsys, "generate", "--model", str(path), "--prompts-file", str(file), "--json",
        "--max-tokens", str(MAX), "--method", "none",
    )  # fmt: skip
    assert status == 0 and len(results) == 2
    for prompt, result in zip(["first prompt", "second one"], results):
        assert result["tokens"] == greedy(path, prompt)
        assert result["method"] == "none"
        assert result["receipt"]["mode"] == "legacy_only"
        assert result["stats"]["cycles"] == 0


def test_convert_round_trip(tiny_dirs, tmp_path, capsys) -> None:
    source = tiny_dirs["deepseek_v3"]
    out = tmp_path / "converted"
    assert main(["convert", str(source), str(out)]) == 0
    capsys.readouterr()
    assert main(["convert", str(source), str(out)]) == 2  # not empty: refused as usage
    capsys.readouterr()
    results = []
    for model_dir in (source, out):
        status, [result], _ = run_json(
            capsys, "generate", "--model", str(model_dir), "--prompt", "round trip", "--json",
            "--max-tokens", str(MAX), *FORCE_ON,
        )  # fmt: skip
        assert status == 0 and result["method"] == "mtp"
        results.append(result)
    assert results[0]["tokens"] == results[1]["tokens"] == greedy(source, "round trip")
    assert results[1]["receipt"]["head_format"] == "melix"


def test_default_model_fallback_is_recorded(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(generate_cmd, "EMBEDDED_CHECKPOINT", tmp_path / "no-such-asset")
    monkeypatch.setenv("MELIX_FSM_CACHE", str(tmp_path / "cache"))
    for _ in range(2):  # built once, then reused
        status, [result], err = run_json(
            capsys, "generate", "--prompt", "Hi", "--json", "--max-tokens", "4", *FORCE_ON
        )
        assert status == 0
        assert "RANDOM deepseek_v3" in err and "not found" in err
        assert result["model_source"] == "fallback_random_tiny"
        assert result["model"] == str(tmp_path / "cache" / "tiny-deepseek_v3")
        assert result["receipt"]["family"] == "deepseek_v3"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-deepseek_v3"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "x", "--max-tokens", "0"],
        ["--prompts-file", "/nonexistent/prompts.txt"],
        ["--prompt", "x", "--num-draft-tokens", "0"],
        ["--prompt", "x", "--temp", "-1"],
    ],
)
def test_usage_errors(tiny_dirs, argv, capsys) -> None:
    assert main(["generate", "--model", str(tiny_dirs["mimo"]), *argv]) == 2
    assert "error" in capsys.readouterr().err


def test_unreadable_checkpoint(tmp_path, capsys) -> None:
    status, lines, err = run_json(capsys, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert status == 2 and lines[0]["error"] == "unreadable_checkpoint"
