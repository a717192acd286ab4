"""The power of `melix-fsm qa`'s distribution property: detection and false-alarm rates.

Rules of this script:
- A script, not a test: `python benchmarks/bench_qa_power.py [--model stdlib-tiny]
  [--dtype float32|bfloat16] [--seeds 0 1 2 3 4] [--conditions ...] [--out FILE [--append]]`.
  `--dtype` casts the model (the draws and the target's probabilities both come from
  the cast model, as in `melix-fsm qa --dtype`); a `melix-fsm convert -q` directory as
  `--model` measures 4-bit weights. The continuations are drawn from
  the law a generator with a planted sampler draws from: at each position, the target's
  own probabilities after the draw's prefix go through the planted transform: the temperature scaled by a
  factor (`temp1.05` draws at 1.05 T), the tail truncated below a probability
  (`tail0.01` drops every token the target gives less than 0.01 at T, then
  renormalises), or nothing (`correct`, for the false-alarm rate). The test's power
  depends on that law only; a generator draws the same law many times slower on CPU.
- The draws are decoded in lockstep over their distinct prefixes, by the same model
  object the target probabilities come from: at each position one forward runs per
  distinct prefix (its row of the KV cache gathered from its parent's), and every draw
  samples its next token from its own prefix's planted distribution. That is the law of
  decoding each draw on its own (draws with the same prefix share its distribution, not
  their samples), with a few thousand rows per run instead of 24,000. The correct
  condition's false-alarm rate checks that this decoding draws the target's law.
- Each seed picks the prompt exactly as the command does (two seeded tokens, then the
  model's greedy continuation of 6) and seeds mlx's generator; the check is the kit's
  `check_distribution` at alpha 1e-3, T = 1, 4 positions. Quick uses the first 2000 of
  the deep run's 8000 draws (the same draws a 2000-draw run would get in law).
- Prints one line per (condition, profile) with detections / seeds, and writes every
  run's p-values as JSON (`--out`, with the date, mlx version, dtype and weights, after
  every run so a cut run keeps what it measured), so docs quote measured numbers only.
  `--append` keeps the file's runs of other conditions (the same model, dtype and
  weights only): one condition per process keeps each run short on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from melix_mlx.loading.checkpoints import resolve_model
from melix_mlx.tools.qa.probabilities import target_probabilities
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm.testing import ConformanceError, check_distribution, mlx_greedy_reference

T = 1.0
PROFILES = {"quick": 2000, "deep": 8000}
CONDITIONS = ("correct", "temp1.05", "temp1.10", "temp1.15", "tail0.01", "tail0.02")


def planted_logits(condition: str, logprobs: mx.array) -> mx.array:
    """The planted sampler's logits from the target's log-probabilities at T."""
    if condition == "correct":
        return logprobs
    if condition.startswith("temp"):
        return logprobs * (1.0 / float(condition[4:]))
    return mx.where(mx.exp(logprobs) < float(condition[4:]), -float("inf"), logprobs)


def draw(model: Any, prompt: list[int], condition: str, n: int, key: mx.array) -> list[tuple[int, ...]]:
    """n continuations of 4 tokens, decoded in lockstep over their distinct prefixes (module rules)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]  # one row per distinct prefix
    node = np.zeros(n, dtype=np.int64)  # each draw's prefix: a row of `logits`
    tokens = []
    for j in range(4):
        scaled = logits.astype(mx.float32) / T
        logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        key, sub = mx.random.split(key)
        rows = planted_logits(condition, logprobs)[mx.array(node)]
        tokens.append(np.array(mx.random.categorical(rows, key=sub)))
        if j == 3:
            break
        # the distinct (prefix, token) pairs are the next position's prefixes
        vocab = logits.shape[-1]
        children, node = np.unique(node * vocab + tokens[-1], return_inverse=True)
        parent = mx.array(children // vocab)
        for c in cache:  # each child's cache row is its parent's
            c.state = [mx.take(a, parent, axis=0) if isinstance(a, mx.array) else a for a in c.state]
        logits = model(mx.array(children % vocab)[:, None], cache=cache)[:, -1, :]
    return [tuple(int(t) for t in row) for row in np.stack(tokens, axis=1).tolist()]


def one_run(model: Any, reference: Any, probs: Any, condition: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    start = [rng.randint(3, 255) for _ in range(2)]
    prompt = start + list(reference(tuple(start), 6))
    draws = draw(model, prompt, condition, PROFILES["deep"], mx.random.key(seed))
    out: dict[str, Any] = {"condition": condition, "seed": seed, "prompt": prompt}
    for profile, n in PROFILES.items():
        try:
            result = check_distribution(draws[:n], probs, prompt, alpha=1e-3)
            detected, where = False, ""
        except ConformanceError as err:
            detected, where, result = True, err.where, None
        out[profile] = {"detected": detected, "where": where}
        if result is not None:
            out[profile]["min_p"] = min(min(p.p_value, p.z_p_value) for p in result.positions)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--append", action="store_true", help="keep --out's runs of other conditions")
    args = parser.parse_args()
    directory = resolve_model(args.model)
    model, _ = load(str(directory))
    if args.dtype is not None:
        model.set_dtype(getattr(mx, args.dtype))
    quant = json.loads((Path(directory) / "config.json").read_text()).get("quantization")
    weights = f"{quant['bits']}-bit, group {quant.get('group_size')}" if isinstance(quant, dict) else "dense"
    began = time.perf_counter()
    reference = mlx_greedy_reference(model, min_tokens=8)
    probs = target_probabilities(model, T)
    runs: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    if args.append and args.out is not None and args.out.exists():
        old = json.loads(args.out.read_text())
        same = (old.get("model"), old.get("dtype"), old.get("weights"))
        if same != (args.model, args.dtype or "as stored", weights):
            parser.error(f"--append: {args.out} holds {same}, not this model, dtype and weights")
        kept = [r for r in old["runs"] if r["condition"] not in args.conditions]

    def save() -> None:  # after every condition, so a run cut short keeps what it measured
        if args.out is None:
            return
        meta = {
            "model": args.model,
            "dtype": args.dtype or "as stored",
            "weights": weights,
            "temperature": T,
            "measured": datetime.now(UTC).isoformat(timespec="minutes"),
            "mlx": version("mlx"),
            "seconds": round(time.perf_counter() - began),
            "decoding": "lockstep over distinct prefixes",
        }
        args.out.write_text(json.dumps({**meta, "runs": kept + runs}, indent=1))

    for condition in args.conditions:
        tic = time.perf_counter()
        for seed in args.seeds:
            runs.append(one_run(model, reference, probs, condition, seed))
            save()
        mine = [r for r in runs if r["condition"] == condition]
        for profile in PROFILES:
            hits = sum(r[profile]["detected"] for r in mine)
            print(
                f"{condition:9s} {profile:5s} ({PROFILES[profile]} draws): detected {hits}/{len(mine)} "
                f"(seeds {args.seeds}; {time.perf_counter() - tic:.0f} s for the condition)",
                flush=True,
            )


if __name__ == "__main__":
    main()
