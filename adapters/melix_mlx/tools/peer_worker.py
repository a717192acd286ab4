"""One contender of melix_mlx.tools.peer_bench (benchmarks/bench_peers.py, `melix-fsm bench
--peer`): a process that loads a checkpoint once and decodes on request (JSON lines on
stdin, one JSON line per answer on stdout). Run as a script, never imported, so the
`peer` role imports nothing of this package (the coordinator sets PYTHONPATH).

    python peer_worker.py ROLE MODEL_DIR [wall|cpu]

The decode window is read on the wall clock, or with `cpu` on this process's CPU clock
(`time.process_time`, every thread's CPU seconds: other processes on a shared machine do
not count, host-device overlap is not credited).

ROLE `melix`: this project's decoders and mlx-lm's own paths, from the installed mlx-lm.
ROLE `peer`: a peer's MTP decoding through the `mlx_lm` found first on PYTHONPATH (the
coordinator puts the peer's checkout there; nothing of the peer is imported by this repo).
ROLE `mlx-vlm`: the installed mlx-vlm's own MTP and plain decoding
(melix_mlx.tools.peers_vlm: its `generate_step` and `BatchGenerator`, the drafter from the
checkpoint's embedded head).

A request: {"method": M, "prompts": [[ids], ...], "max_tokens": N, "k": K, "batch": b}. M is one of
`mlx_lm` (stream_generate / BatchGenerator), `melix` (mtp_stream_generate /
MTPBatchGenerator at depth K, speculation always on) for ROLE melix, `peer`
(`stream_generate(..., mtp=True)` / `BatchGenerator(..., mtp=True)`) for ROLE peer, and
`vlm_mtp` (depth K) / `vlm_plain` for ROLE mlx-vlm. One prompt is a single-sequence run;
several are one batch, all inserted at once.
Other requests: `calibrate` (ROLE melix: this project's calibrated forward times per k
and batch size at the given context, for the ideal bound) and `profile` (ROLE melix:
the engine's cycle clock over one MTP run; ROLE mlx-vlm: peers_vlm.profile_cycles).

An answer: {"tokens": [[ids], ...], "decode_s": s, "decode_tokens": n} (speculative methods
of melix and mlx-vlm add "cycles", rounds, and "accepted_mean", accepted drafts per row and
round): the decode window runs from the moment every row has its first token to the last
token, and counts the tokens after each row's first, so prefill, which every method does
alike, is left out.
Greedy only: identity is a property of greedy decoding.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

CLOCK: list[Callable[[], float]] = [time.perf_counter]  # set once by main: the decode window's clock


def _load(role: str, model_dir: str) -> tuple[Any, Any, Any]:
    if role == "mlx-vlm":
        from melix_mlx.tools.peers_vlm import load_peer

        peer = load_peer(model_dir)
        return peer, peer.tokenizer, None
    if role == "melix":
        from melix_mlx.loading import load_with_heads

        model, tokenizer, head, _ = load_with_heads(model_dir)
        return model, tokenizer, head
    from mlx_lm import load  # the peer's own loader keeps its MTP weights

    model, tokenizer = load(model_dir)
    if not hasattr(model, "mtp_forward"):
        raise SystemExit("the peer's model has no mtp_forward: not an MTP build of mlx_lm, or no head")
    return model, tokenizer, None


def _single(responses: Iterable[Any], last: list[Any] | None = None) -> tuple[list[int], float, int]:
    tokens: list[int] = []
    first = None
    for response in responses:
        tokens.append(int(response.token))
        if last is not None:
            last[:] = [response]
        if first is None:
            first = CLOCK[0]()
    end = CLOCK[0]()
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
            started = CLOCK[0]()
            before = sum(len(r) for r in rows.values())
    end = CLOCK[0]()
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
    if role == "mlx-vlm" or method.startswith("vlm_"):
        if role != "mlx-vlm" or method not in ("vlm_mtp", "vlm_plain"):
            raise ValueError(f"method {method} needs the mlx-vlm role (vlm_mtp or vlm_plain)")
        from melix_mlx.tools.peers_vlm import decode

        depth = k if method == "vlm_mtp" else None
        return decode(model, prompts, max_tokens, depth, bool(request.get("batch")), CLOCK[0]).answer()
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
        last: list[Any] = []
        tokens, seconds, counted = _single(out, last)
        rows = [tokens]
        stats = _stats(last[0].stats) if method == "melix" and last else None
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
        stats = _stats(gen.speculative_stats()) if method == "melix" else None
        gen.close()
    return {"tokens": rows, "decode_s": seconds, "decode_tokens": counted, **(stats or {})}


def _stats(stats: Any) -> dict[str, Any]:
    """Rounds (verify forwards) and accepted drafts per row and round, from our counters."""
    read = stats.get if isinstance(stats, dict) else lambda key: getattr(stats, key)
    row_cycles = read("cycles")
    return {"cycles": read("target_forwards"), "accepted_mean": read("accepted") / max(row_cycles, 1)}


CALIBRATION_TRIES = 4


def _calibrate(model: Any, head: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Calibrated forward times (ms) per k and batch size at `context` tokens (the ideal)."""
    from melix_fsm.policy.calibration import DEFAULT_BUDGET_S
    from melix_fsm.policy.cost_model import TimingTable
    from melix_mlx.runtime.calibrate import calibrate

    sizes = [int(b) for b in request["batch_sizes"]]
    out: dict[str, Any] = {}
    for k in request["ks"]:
        for _ in range(CALIBRATION_TRIES):  # a shared machine poisons some measurements
            table = calibrate(
                model, head, batch_sizes=sizes, k=int(k), runs=9, context=int(request["context"]),
                budget_s=DEFAULT_BUDGET_S * len(sizes), timer=CLOCK[0],
            )  # fmt: skip
            if isinstance(table, TimingTable):
                break
        if not isinstance(table, TimingTable):
            out[str(k)] = {"error": str(table)}
            continue
        out[str(k)] = {
            str(b): {name: getattr(table.at(b)[0], name) * 1e3 for name in ("t_1", "t_verify", "t_head")}
            for b in sizes
        }
    return out


def _profile(role: str, model: Any, tokenizer: Any, head: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Where one single-sequence MTP run's cycles go (ms per cycle)."""
    prompt, max_tokens, k = request["prompts"][0], int(request["max_tokens"]), int(request["k"])
    if role == "mlx-vlm":
        from melix_mlx.tools.peers_vlm import profile_cycles

        return profile_cycles(model, prompt, max_tokens, k, CLOCK[0])
    from melix_mlx.generate import mtp_stream_generate
    from melix_mlx.runtime.cycle_clock import CycleClock

    clock = CycleClock()
    last: list[Any] = []
    out = mtp_stream_generate(
        model,
        tokenizer,
        prompt,
        head,
        max_tokens=max_tokens,
        num_draft_tokens=k,
        sampler=_greedy(),
        clock=clock,
    )
    _, seconds, _ = _single(out, last)
    stats = _stats(last[0].stats)
    parts = {name: value * 1e3 for name, value in clock.per_cycle().items()}
    cycle = seconds / max(stats["cycles"], 1) * 1e3
    return {"k": k, **stats, "ms_per_cycle": {**parts, "cycle": cycle}}


def main() -> None:
    role, model_dir = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["cpu"]:
        CLOCK[0] = time.process_time
    model, tokenizer, head = _load(role, model_dir)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        method = request.get("method")
        if method == "encode":
            answer: dict[str, Any] = {"ids": [tokenizer.encode(t) for t in request["texts"]]}
        elif method in ("calibrate", "profile"):
            try:
                if method == "calibrate":
                    answer = _calibrate(model, head, request)
                else:
                    answer = _profile(role, model, tokenizer, head, request)
            except Exception as exc:  # reported as that request's error
                answer = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            try:
                answer = _run(role, model, tokenizer, head, request)
            except Exception as exc:  # reported to the coordinator, which records the crash
                answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
