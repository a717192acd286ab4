"""MTP under mx.distributed: two ranks over the ring backend on 127.0.0.1.

Each launch (`mlx.launch --backend ring -n 2`, bounded by a subprocess timeout) runs
tests/adapters/distributed_worker.py on both ranks, for every family this project runs
that mlx-lm 0.32 can shard, tensor and pipeline:

- greedy MTP tokens equal the single-process run (mlx-lm's own greedy output on the
  unsharded model) and mlx-lm's greedy output on the same sharded model;
- every rank writes the same receipt (calibration figures included: rank 0's), the same
  tokens and the same lifecycle counts;
- `melix-fsm generate --sharding ... --prompts-file` (MTPBatchGenerator) prints JSON on
  rank 0 only, marked as agreed by every rank, with the single-process tokens;
- a failure on one rank ends every rank with a non-zero status, the failing one with a
  typed error (the survivor: typed `peer_lost`, or stopped by mlx.launch; see
  melix_mlx.runtime.distributed);
- what mlx-lm cannot shard is refused with `unsupported_sharding` before any weight is read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from melix_fsm.reasons import RefusalReason

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["import os", "class Parser:", "def main():"]
LAUNCH_TIMEOUT_S = 600  # a hang fails the test instead of the suite (a loaded CPU is slow)

pytestmark = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch not installed")


def _launch(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])
    cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "--", sys.executable, str(WORKER), *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


def _single_process(model_dir: Path, prompt: str, max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens on the unsharded model, in this process."""
    from melix_mlx.loading import load_main
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load_tokenizer

    model, config = load_main(model_dir)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id", None))
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    eos = set(tokenizer.eos_token_ids)
    return tokens if not tokens or tokens[-1] not in eos else tokens[:-1]


def _checkpoint(name: str, tiny_checkpoint) -> Path:
    from melix_mlx.loading.checkpoints import EMBEDDED

    if name in EMBEDDED:
        return EMBEDDED[name]
    return tiny_checkpoint(name)  # a make-tiny family (random weights)


CASES = [
    pytest.param("stdlib-tiny", "pipeline", id="deepseek_v3-pipeline"),
    pytest.param("deepseek_v3", "tensor", id="deepseek_v3-tensor"),  # stdlib-tiny has 3 heads
    pytest.param("stdlib-hybrid", "tensor", id="qwen3_5-tensor"),
    pytest.param("stdlib-hybrid", "pipeline", id="qwen3_5-pipeline"),
]


def _worker_constants() -> tuple[str, int]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROMPT, module.MAX_TOKENS


@pytest.mark.parametrize("name, sharding", CASES)
def test_two_ranks_match_single_process(name: str, sharding: str, tmp_path: Path, tiny_checkpoint) -> None:
    model_dir = _checkpoint(name, tiny_checkpoint)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    done = _launch("run", str(model_dir), sharding, str(tmp_path), str(prompts), tmp_path=tmp_path)
    assert "exited with code" not in done.stderr and "was killed" not in done.stderr, done.stderr[-3000:]

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    prompt, max_tokens = _worker_constants()
    expected = _single_process(model_dir, prompt, max_tokens)
    for result in ranks:
        assert result["tokens"][: len(expected)] == expected  # MTP == single process
        assert result["plain_tokens"][: len(expected)] == expected  # mlx-lm sharded == single process
    # one decision everywhere: receipt (rank 0's calibration), tokens, lifecycle counts, depth
    assert ranks[0] == ranks[1]
    assert ranks[0]["counts"]["accepted"] + ranks[0]["counts"]["rejected"] > 0  # cycles ran
    receipt = ranks[0]["receipt"]
    assert receipt["hardware"] is not None, receipt

    # the CLI: rank 0 prints one agreed JSON line per prompt, rank 1 prints nothing
    assert [(tmp_path / f"cli{r}.status").read_text() for r in (0, 1)] == ["0", "0"]
    assert (tmp_path / "cli1.txt").read_text() == ""
    lines = [json.loads(line) for line in (tmp_path / "cli0.txt").read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert line["distributed"] == {"ranks": 2, "sharding": sharding, "agreed": True}
        reference = _single_process(model_dir, PROMPTS[line["index"]], 12)
        assert line["tokens"] == reference, (PROMPTS[line["index"]], line["tokens"], reference)
        assert line["method"] == "mtp"


@pytest.mark.slow
@pytest.mark.parametrize("name, sharding", [("stdlib-hybrid", "tensor"), ("stdlib-tiny", "pipeline")])
def test_sampled_ranks_agree(name: str, sharding: str, tmp_path: Path, tiny_checkpoint) -> None:
    """Each rank seeds its own random stream; the draws that count are rank 0's."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    model_dir = _checkpoint(name, tiny_checkpoint)
    done = _launch("sampled", str(model_dir), sharding, str(tmp_path), str(prompts), tmp_path=tmp_path)
    assert "exited with code" not in done.stderr, done.stderr[-3000:]
    assert [(tmp_path / f"cli{r}.status").read_text() for r in (0, 1)] == ["0", "0"]
    lines = [json.loads(line) for line in (tmp_path / "cli0.txt").read_text().splitlines()]
    assert len(lines) == len(PROMPTS)
    for line in lines:
        assert line["distributed"]["agreed"] is True  # digest of every rank's tokens and receipt
        assert line["stats"]["proposed"] > 0


def test_failure_on_one_rank_ends_every_rank_typed(tmp_path: Path) -> None:
    from melix_mlx.loading.checkpoints import EMBEDDED

    done = _launch("fail", str(EMBEDDED["stdlib-hybrid"]), "tensor", str(tmp_path), tmp_path=tmp_path)
    errors = {}
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{") and '"error"' in line:
            data = json.loads(line)
            errors.setdefault(data["rank"], set()).add(data["error"])
    assert errors.get(1) == {"rank_failed"}, done.stderr[-3000:]
    # mlx.launch itself exits 0; it logs each rank's status
    statuses = dict(re.findall(r"Node with rank (\d) exited with code (-?\d+)", done.stderr))
    assert statuses.get("1") == "4", done.stderr[-3000:]
    # the survivor ends too (no hang: we are past the launch timeout's guard), non-zero:
    # typed (peer_lost, status 4) when the ring backend wakes it first, else stopped by
    # the launcher's SIGTERM (-15)
    assert statuses.get("0") in ("4", "-15"), done.stderr[-3000:]
    if statuses["0"] == "4":
        assert errors.get(0) == {"peer_lost"}, done.stderr[-3000:]


# -- refusals: decided from the config and the group size, before any weight is read --
class _Group:
    """Stands in for a 2-rank group (no collective is reached before the refusal)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    "name, sharding, why",
    [
        ("stdlib-tiny", "tensor", "num_attention_heads=3 not divisible by 2 ranks"),
        ("mimo", "tensor", "mlx-lm has no tensor sharding for mimo"),
        ("mimo", "pipeline", "mlx-lm has no pipeline sharding for mimo"),
    ],
)
def test_unshardable_is_refused_typed(name: str, sharding: str, why: str, tiny_checkpoint) -> None:
    from melix_mlx.runtime.distributed import ShardingRefused, load_sharded

    from melix_fsm.errors import MelixError

    with pytest.raises(ShardingRefused) as info:
        load_sharded(_checkpoint(name, tiny_checkpoint), sharding, _Group())
    assert why in str(info.value)
    assert info.value.reason == RefusalReason.unsupported_sharding
    assert isinstance(info.value, MelixError)
