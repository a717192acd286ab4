"""One contender of benchmarks/bench_peers.py: a process that loads a checkpoint once and
decodes on request (JSON lines on stdin, one JSON line per answer on stdout).

    python peer_worker.py ROLE MODEL_DIR

ROLE `melix`: this project's decoders and mlx-lm's own paths, from the installed mlx-lm.
ROLE `peer`: a peer's MTP decoding through the `mlx_lm` found first on PYTHONPATH (the
coordinator puts the peer's checkout there; nothing of the peer is imported by this repo).

A request: {"method": M, "prompts": [[ids], ...], "max_tokens": N, "k": K, "batch": b}. M is one of
`mlx_lm` (stream_generate / BatchGenerator), `melix` (mtp_stream_generate /
MTPBatchGenerator at depth K, speculation always on) for ROLE melix, and `peer`
(`stream_generate(..., mtp=True)` / `BatchGenerator(..., mtp=True)`) for ROLE peer. One
prompt is a single-sequence run; several are one batch, all inserted at once.

An answer: {"tokens": [[ids], ...], "decode_s": s, "decode_tokens": n}: the decode window
runs from the moment every row has its first token to the last token, and counts the
tokens after each row's first, so prefill, which every method does alike, is left out.
Greedy only: identity is a property of greedy decoding.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from typing import Any


def _load(role: str, model_dir: str) -> tuple[Any, Any, Any]:
    if role == "melix":
        from melix_mlx.loading import load_with_heads

        model, tokenizer, head, _ = load_with_heads(model_dir)
        return model, tokenizer, head
    from mlx_lm import load  # the peer's own loader keeps its MTP weights

    model, tokenizer = load(model_dir)
    if not hasattr(model, "mtp_forward"):
        raise SystemExit("the peer's model has no mtp_forward: not an MTP build of mlx_lm, or no head")
    return model, tokenizer, None


def _single(responses: Iterable[Any]) -> tuple[list[int], float, int]:
    tokens: list[int] = []
    first = None
    for response in responses:
        tokens.append(int(response.token))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return tokens, end - (first or end), max(len(tokens) - 1, 0)


def _batch(gen: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    rows: dict[int, list[int]] = {uid: [] for uid in uids}
    started = None
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        for response in responses:
            rows[response.uid].append(int(response.token))
        if started is None and all(rows.values()):
            started = time.perf_counter()
            before = sum(len(r) for r in rows.values())
    end = time.perf_counter()
    total = sum(len(r) for r in rows.values())
    if started is None:
        return [rows[u] for u in uids], 0.0, 0
    return [rows[u] for u in uids], end - started, total - before


def _greedy() -> Any:
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=0.0)


def _run(role: str, model: Any, tokenizer: Any, head: Any, request: dict[str, Any]) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator, stream_generate

    method, prompts = request["method"], request["prompts"]
    max_tokens, k = int(request["max_tokens"]), int(request.get("k", 2))
    slots = {"completion_batch_size": len(prompts), "prefill_batch_size": len(prompts)}
    if method == "peer" and role != "peer" or method == "melix" and role != "melix":
        raise ValueError(f"method {method} needs the {method} role")
    if not request.get("batch"):
        if len(prompts) != 1:
            raise ValueError("a single-sequence run takes one prompt")
        prompt = prompts[0]
        if method == "mlx_lm":
            out = stream_generate(model, tokenizer, prompt, max_tokens, sampler=_greedy())
        elif method == "peer":
            out = stream_generate(model, tokenizer, prompt, max_tokens, mtp=True)
        else:
            from melix_mlx.generate import mtp_stream_generate

            out = mtp_stream_generate(
                model, tokenizer, prompt, head, max_tokens=max_tokens, num_draft_tokens=k, sampler=_greedy()
            )
        tokens, seconds, counted = _single(out)
        rows = [tokens]
    else:
        if method == "mlx_lm":
            gen = BatchGenerator(model, max_tokens=max_tokens, sampler=_greedy(), **slots)
        elif method == "peer":
            gen = BatchGenerator(model, max_tokens=max_tokens, sampler=_greedy(), mtp=True, **slots)
        else:
            from melix_mlx.batch_generator import MTPBatchGenerator

            gen = MTPBatchGenerator(
                model, head, num_draft_tokens=k, max_tokens=max_tokens, sampler=_greedy(), **slots
            )
        rows, seconds, counted = _batch(gen, prompts, max_tokens)
        gen.close()
    return {"tokens": rows, "decode_s": seconds, "decode_tokens": counted}


def main() -> None:
    role, model_dir = sys.argv[1], sys.argv[2]
    model, tokenizer, head = _load(role, model_dir)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("method") == "encode":
            answer: dict[str, Any] = {"ids": [tokenizer.encode(t) for t in request["texts"]]}
        else:
            try:
                answer = _run(role, model, tokenizer, head, request)
            except Exception as exc:  # reported to the coordinator, which records the crash
                answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
