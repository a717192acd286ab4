"""The one-line summary `melix-fsm generate` prints on stderr without --json.

Rules of this module:
- A pure function of the results `generate` already has (the per-prompt results, the
  common fields with the receipt, and the wall time of a batched decode): it says how the
  run decoded (method and k, or plain and why), how many tokens at what rate, the draft
  acceptance, and the speedup over plain decoding where the policy has an estimate (the
  live controller's measured one, else the receipt's prediction). Nothing is measured here.
- The full receipt is not repeated: `--receipt` prints it, `--json` puts it in every result.
- No mlx import. `emit` prints what `generate` prints (JSON lines, texts, the summary),
  for its text path and its VL path alike.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _speculated(results: list[dict[str, Any]]) -> tuple[int, int]:
    """(accepted, proposed) draft tokens over every result."""
    stats = [r.get("stats") or {} for r in results]
    return sum(s.get("accepted", 0) for s in stats), sum(s.get("proposed", 0) for s in stats)


def _speedup(results: list[dict[str, Any]], receipt: dict[str, Any]) -> str | None:
    """The policy's estimate of the speedup over plain decoding, with its kind."""
    for r in results:
        policy = (r.get("stats") or {}).get("policy") or {}
        if policy.get("measured_speedup") is not None:
            return f"{policy['measured_speedup']:.2f}x plain (measured)"
    predicted = (receipt.get("hardware") or {}).get("predicted_speedup")
    return f"{predicted:.2f}x plain (predicted)" if predicted is not None else None


def _prompt_acceptance(results: list[dict[str, Any]]) -> float | None:
    """What the sampled prompts scored before the first step (LiveController.price_prompts)."""
    for r in results:
        priced = ((r.get("stats") or {}).get("policy") or {}).get("prompt_acceptance")
        if priced is not None:
            return float(priced)
    return None


def _how(common: dict[str, Any], results: list[dict[str, Any]]) -> str:
    method = common["method"]
    if method == "none":
        reasons = {(r.get("stats") or {}).get("refusal_reason") for r in results} - {None}
        reason = common["receipt"].get("refusal_reason") or next(iter(sorted(reasons)), None)
        return "plain decode" + (f" ({reason})" if reason else "")
    k = common["num_draft_tokens"]
    if k == "auto":
        return f"{method} k=auto (ended at k={common.get('depth')})"
    return f"{method} k={k}"


def summary(prog: str, results: list[dict[str, Any]], common: dict[str, Any], wall_s: float | None) -> str:
    """`prog: <how>: <tokens and rate>, acceptance <a> (<accepted>/<proposed> drafts), <speedup>`."""
    tokens = sum(len(r["tokens"]) for r in results)
    if len(results) == 1 and results[0].get("generation_tps") is not None:
        rate = f"{tokens} tokens, {results[0]['generation_tps']:.1f} tok/s"
    elif wall_s:
        rate = f"{len(results)} prompts, {tokens} tokens in {wall_s:.2f} s ({tokens / wall_s:.1f} tok/s)"
    else:
        rate = f"{len(results)} prompts, {tokens} tokens"
    line = f"{prog}: {_how(common, results)}: {rate}"
    if common["method"] == "none":
        return line
    accepted, proposed = _speculated(results)
    if not proposed:  # admitted, but the device policy kept speculation off throughout
        priced = _prompt_acceptance(results)
        why = f": the prompt's sampled acceptance {priced:.2f} does not pay" if priced is not None else ""
        return line + f", no drafts (the device policy decoded plainly{why})"
    line += f", acceptance {accepted / proposed:.2f} ({accepted}/{proposed} drafts)"
    speedup = _speedup(results, common["receipt"])
    return line + (f", {speedup}" if speedup is not None else "")


def emit(
    prog: str, results: list[dict[str, Any]], common: dict[str, Any], wall_s: float, as_json: bool
) -> None:
    """One JSON line per result (with the common fields), or the texts of a batch and the
    summary on stderr."""
    for i, result in enumerate(results):
        if as_json:
            print(json.dumps({"index": i, **result, **common}))
        elif len(results) > 1:
            print(result["text"])
    sys.stdout.flush()
    if not as_json:
        print(summary(prog, results, common, wall_s), file=sys.stderr)
