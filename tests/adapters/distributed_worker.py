"""One rank of a distributed test run; launched by tests/adapters/test_distributed.py.

    mlx.launch --backend ring -n 2 -- python distributed_worker.py run MODEL SHARDING OUT PROMPTS
    mlx.launch --backend ring -n 2 -- python distributed_worker.py fail MODEL SHARDING OUT

`run`: every rank loads the checkpoint sharded (melix_mlx.runtime.distributed), calibrates under
the auto policy (rank 0's figures: the receipt), decodes one prompt greedily with MTP
through `mtp_stream_generate` (speculation forced on, depth chosen live) and the same prompt with
mlx-lm's own `stream_generate` on the same sharded model, and writes OUT/rank{r}.json.
Then it runs `melix-fsm generate --sharding ... --prompts-file PROMPTS --json` (the
batched generator) in-process, its stdout going to OUT/cli{r}.txt.

`sampled`: the batched CLI at temperature 0.9 with a different random seed per rank.

`fail`: the same decode through `run_ranks`, with a logits processor that raises on
rank 1 only, at its third call; every rank must end with a typed error.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import mlx.core as mx

PROMPT = "def parse_args(argv):"
MAX_TOKENS = 20


def _decode(model_dir: str, sharding: str, *, processors=None, policy: str = "auto") -> dict:
    from melix_mlx.decoding.activation import evaluate
    from melix_mlx.generate import mtp_stream_generate
    from melix_mlx.runtime.distributed import load_sharded
    from mlx_lm.generate import stream_generate

    from melix_fsm.config import speculative_config
    from melix_fsm.receipt import receipt_json, resolve

    model, tokenizer, head, _ = load_sharded(model_dir, sharding)
    # the receipt: measured under the auto policy (rank 0's figures on every rank)
    config = speculative_config(method="mtp", num_draft_tokens="auto", device_policy=policy)
    activation = evaluate(model, head, resolve(model_dir, config), config, batch_size=1, budget_s=120.0)
    # the decode: speculation forced on (a loaded CPU may measure "off"), depth chosen live
    forced = speculative_config(method="mtp", num_draft_tokens="auto", device_policy="force_on")
    controller = evaluate(model, head, resolve(model_dir, forced), forced, batch_size=1).controller
    tokens, last = [], None
    for r in mtp_stream_generate(
        model,
        tokenizer,
        PROMPT,
        head,
        max_tokens=MAX_TOKENS,
        num_draft_tokens=controller.depth.max_k,
        controller=controller,
        logits_processors=processors,
    ):
        tokens.append(r.token)
        last = r
    plain = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS)]
    stats = last.stats
    return {
        "receipt": json.loads(receipt_json(activation.receipt)),
        "tokens": tokens,
        "plain_tokens": plain,
        "counts": {k: stats.get(k) for k in ("accepted", "rejected", "target_forwards", "state")},
        "depth": controller.k,
    }


def run(model_dir: str, sharding: str, out: Path, prompts: str) -> int:
    from melix_fsm.cli import main

    rank = mx.distributed.init().rank()
    result = _decode(model_dir, sharding)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    argv = ["generate", "--model", model_dir, "--sharding", sharding, "--prompts-file", prompts]
    argv += ["--json", "--max-tokens", "12", "--num-draft-tokens", "2", "--device-policy", "force_on"]
    with open(out / f"cli{rank}.txt", "w") as sink, contextlib.redirect_stdout(sink):
        status = main(argv)
    (out / f"cli{rank}.status").write_text(str(status))
    return 0


def sampled(model_dir: str, sharding: str, out: Path, prompts: str) -> int:
    """The batched CLI with sampling: every draw is rank 0's, so the ranks still agree."""
    from melix_fsm.cli import main

    rank = mx.distributed.init().rank()
    mx.random.seed(1234 + rank)  # different streams per rank: agreement must not rely on seeds
    argv = ["generate", "--model", model_dir, "--sharding", sharding, "--prompts-file", prompts, "--json"]
    argv += ["--max-tokens", "16", "--num-draft-tokens", "2", "--device-policy", "force_on", "--temp", "0.9"]
    with open(out / f"cli{rank}.txt", "w") as sink, contextlib.redirect_stdout(sink):
        status = main(argv)
    (out / f"cli{rank}.status").write_text(str(status))
    return 0


def fail(model_dir: str, sharding: str) -> int:
    from melix_mlx.runtime.distributed import run_ranks

    rank = mx.distributed.init().rank()
    calls = [0]

    def processor(history: mx.array, logits: mx.array) -> mx.array:
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise ValueError("planted failure on rank 1")
        return logits

    def body() -> int:
        _decode(model_dir, sharding, processors=[processor], policy="force_on")
        return 0

    return run_ranks(body, json_output=True, sharding=sharding)


if __name__ == "__main__":
    what, model_dir, sharding, out = sys.argv[1:5]
    if what == "run":
        sys.exit(run(model_dir, sharding, Path(out), sys.argv[5]))
    if what == "sampled":
        sys.exit(sampled(model_dir, sharding, Path(out), sys.argv[5]))
    sys.exit(fail(model_dir, sharding))
