"""mlx-vlm's own decoding as a benchmark peer: its MTP speculative decode and its plain
decode on the same checkpoint, used from the user's install (`import mlx_vlm`), never vendored.

Rules of this module:
- mlx_vlm is imported only inside the functions, so this module imports anywhere.
- `load_peer` loads what `python -m mlx_vlm.generate --draft-kind mtp --draft-model DIR`
  loads: mlx-vlm's model and processor, and its MTP drafter built from the same
  checkpoint's embedded head (`load_drafter(DIR, kind="mtp")`).
- Depth: mlx-vlm counts a block (the last token plus its drafts), so k drafts are
  `draft_block_size = k + 1`. Its drafter must take the requested block as it is
  (`prefer_requested_block_size`); one that treats it as an adaptive ceiling would not run
  the depth a cell names, so `load_peer` refuses it.
- `decode` runs one request (mlx-vlm's `generate_step`, greedy) or a batch (its
  `BatchGenerator`, greedy: with a drafter that is a speculative cohort), k None for plain
  decoding. The decode window runs from the moment every row has its first token to the
  last token and counts the tokens after each row's first (prefill, which every
  contender does alike, is left out), as melix_mlx/tools/peer_worker.py does for every peer.
- Acceptance is the drafter's own per-round record (`accept_lens`, reset at a run's
  start): in a batch each round records the mean over its rows.
- `QABatch` puts mlx-vlm's `BatchGenerator` (with the drafter: speculative cohorts) behind
  the kit's batch surface (melix_fsm.testing.surfaces.BatchSurface): its `insert` takes
  no stop sequences, so a request's stop object (mlx-lm's `StopSequences`, the one the
  kit hands mlx-lm's generator) is matched here on each emitted token and a stopped
  request is removed from mlx-vlm's batch; its `remove` takes one uid; a finish it
  reports without a token (`token=None`) is put on the request's previous token, which
  is therefore held back one response. Nothing else is added or corrected.
- `profile_cycles` times the parts of mlx-vlm's single-sequence MTP cycle by wrapping its
  functions for the duration of one call and evaluating each part's output before the
  clock stops (a synchronised profile: parts that overlap in a normal run are serialised,
  so its cycle is longer than an unprofiled one; both are reported). The wrappers are
  removed when the call returns, also on an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from melix_fsm.errors import MelixError

Timer = Callable[[], float]


class PeerSetupError(MelixError, ValueError):
    """mlx-vlm is missing, or its drafter cannot run the depth a cell names."""


@dataclass
class VLMPeer:
    model: Any
    processor: Any
    drafter: Any

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)


@dataclass
class PeerRun:
    tokens: list[list[int]]
    decode_s: float
    decode_tokens: int
    cycles: int = 0  # speculative rounds (0: plain)
    accepted: list[float] = field(default_factory=list)  # per round (a batch: its rows' mean)

    def answer(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.tokens, "decode_s": self.decode_s}
        out["decode_tokens"] = self.decode_tokens
        if self.cycles:
            out["cycles"] = self.cycles
            out["accepted_mean"] = sum(self.accepted) / len(self.accepted)
        return out


def load_peer(model_dir: str | Path) -> VLMPeer:
    try:
        from mlx_vlm.speculative.drafters import load_drafter
        from mlx_vlm.utils import load
    except ImportError as exc:
        raise PeerSetupError(f"mlx-vlm is not installed ({exc}): pip install 'melix-fsm[vlm]'") from exc
    model, processor = load(str(model_dir))
    drafter, kind = load_drafter(str(model_dir), kind="mtp")
    if kind != "mtp":
        raise PeerSetupError(f"{model_dir}: mlx-vlm loads its drafter as {kind!r}, not an MTP head")
    if not getattr(drafter, "prefer_requested_block_size", False):
        raise PeerSetupError(
            f"{type(drafter).__name__} takes the block size as an adaptive ceiling: k would not hold"
        )
    return VLMPeer(model, processor, drafter)


def _spec(peer: VLMPeer, k: int | None) -> dict[str, Any]:
    if k is None:
        return {}
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return {"draft_model": peer.drafter, "draft_kind": "mtp", "draft_block_size": k + 1}


def _single(peer: VLMPeer, prompt: list[int], max_tokens: int, k: int | None, timer: Timer) -> PeerRun:
    from mlx_vlm.generate.ar import generate_step

    ids = mx.array([prompt])
    steps = generate_step(
        ids, peer.model, None, None, max_tokens=max_tokens, temperature=0.0, **_spec(peer, k)
    )
    tokens: list[int] = []
    first = None
    for token, _ in steps:
        tokens.append(int(token))
        if first is None:
            first = timer()
    end = timer()
    run = PeerRun([tokens], end - (first or end), max(len(tokens) - 1, 0))
    if k is not None:
        run.accepted = list(peer.drafter.accept_lens)
        run.cycles = len(run.accepted)
    return run


def _embedded(peer: VLMPeer, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Each row's prompt keywords as mlx-vlm's `batch_generate` builds them (text only: the
    embeddings and whatever else its `get_input_embeddings` returns)."""
    out = []
    for prompt in prompts:
        embedded = peer.model.get_input_embeddings(mx.array([prompt]), None, mask=None)
        out.append({k: v for k, v in embedded.to_dict().items() if v is not None})
    return out


def _batch(peer: VLMPeer, prompts: list[list[int]], max_tokens: int, k: int | None, timer: Timer) -> PeerRun:
    from mlx_vlm.generate.ar import BatchGenerator

    slots = {"completion_batch_size": len(prompts), "prefill_batch_size": len(prompts)}
    lm = peer.model.language_model  # what mlx-vlm's own batch_generate hands its generator
    gen = BatchGenerator(lm, peer.processor, max_tokens=max_tokens, **slots, **_spec(peer, k))
    try:
        uids = gen.insert(
            prompts, max_tokens=[max_tokens] * len(prompts), prompt_kwargs=_embedded(peer, prompts)
        )
        rows: dict[int, list[int]] = {uid: [] for uid in uids}
        started, before = None, 0
        while gen.has_work:
            _, responses = gen.next()
            for response in responses:
                if response.token is not None:
                    rows[response.uid].append(int(response.token))
            if started is None and all(rows.values()):
                started = timer()
                before = sum(len(r) for r in rows.values())
        end = timer()
    finally:
        gen.close()
    tokens = [rows[u] for u in uids]
    counted = sum(len(r) for r in tokens) - before
    run = PeerRun(tokens, end - started if started else 0.0, counted if started else 0)
    if k is not None:
        run.accepted = [float(a) for a in peer.drafter.accept_lens]
        run.cycles = len(run.accepted)
    return run


def decode(
    peer: VLMPeer,
    prompts: list[list[int]],
    max_tokens: int,
    k: int | None,
    batch: bool,
    timer: Timer = time.perf_counter,
) -> PeerRun:
    """One run: a single sequence (`batch` False, one prompt) or a batch of all `prompts`,
    its decode window read on `timer` (wall clock, or `time.process_time`: CPU seconds)."""
    if not batch:
        if len(prompts) != 1:
            raise ValueError("a single-sequence run takes one prompt")
        return _single(peer, prompts[0], max_tokens, k, timer)
    return _batch(peer, prompts, max_tokens, k, timer)


# -- the qa kit's surface --------------------------------------------------------------------


class QABatch:
    """mlx-vlm's `BatchGenerator` with the kit's batch calls (see the module rules)."""

    def __init__(self, peer: VLMPeer, k: int | None, sampler: Any = None, **slots: int) -> None:
        from mlx_vlm.generate.ar import BatchGenerator

        self.peer = peer
        self.gen = BatchGenerator(
            peer.model.language_model, peer.processor, sampler=sampler, **slots, **_spec(peer, k)
        )
        self.matchers: dict[int, Any] = {}
        self.held: dict[int, int] = {}  # each open request's latest token, not yet handed out
        self.ended: set[int] = set()

    def insert(
        self, prompts: list[list[int]], max_tokens: list[int], stop_sequences: Any = None
    ) -> list[int]:
        kwargs = _embedded(self.peer, prompts)
        uids = self.gen.insert(prompts, max_tokens=max_tokens, prompt_kwargs=kwargs)
        for uid, stops in zip(uids, stop_sequences or [None] * len(uids)):
            if stops is not None:
                self.matchers[uid] = stops.matcher()
        return uids

    def next(self) -> tuple[list[Any], list[Any]]:
        from mlx_vlm.generate.ar import GenerationBatch

        out: list[Any] = []

        def emit(uid: int, token: int, reason: str | None) -> None:
            out.append(
                GenerationBatch.Response(uid=uid, token=token, token_logprob=0.0, finish_reason=reason)
            )

        _, responses = self.gen.next()
        for r in responses:
            if r.uid in self.ended:
                continue  # a request this adapter stopped, still in mlx-vlm's round
            if r.token is None:  # a finish without a token: it belongs to the held one
                if r.uid in self.held:
                    emit(r.uid, self.held.pop(r.uid), r.finish_reason)
                self.ended.add(r.uid)
                continue
            if r.uid in self.held:
                emit(r.uid, self.held.pop(r.uid), None)
            matcher = self.matchers.get(r.uid)
            if matcher is not None and matcher.advance(int(r.token)) and r.finish_reason is None:
                emit(r.uid, int(r.token), "stop")
                self.ended.add(r.uid)
                self.gen.remove(r.uid)
            elif r.finish_reason is not None:
                emit(r.uid, int(r.token), r.finish_reason)
                self.ended.add(r.uid)
            else:
                self.held[r.uid] = int(r.token)
        return [], out

    def remove(self, uids: list[int]) -> None:
        for uid in uids:
            self.held.pop(uid, None)
            self.ended.add(uid)
            self.gen.remove(uid)

    def close(self) -> None:
        self.gen.close()


# -- where mlx-vlm's cycle goes ---------------------------------------------------------------

PARTS = ("draft", "verify", "accept", "head_catch_up", "commit")


def _arrays(value: Any) -> list[mx.array]:
    """Every mlx array in a (nested) value, for a forced evaluation."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    state = getattr(value, "state", None)
    return _arrays(state) if state is not None and not isinstance(value, type) else []


@contextmanager
def _timed(totals: dict[str, float], peer: VLMPeer, caches: list[Any], timer: Timer) -> Iterator[None]:
    from mlx_vlm.speculative import mtp

    def wrap(name: str, fn: Any, settle: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = timer()
            out = fn(*args, **kwargs)
            mx.eval(_arrays(settle(out)))
            totals[name] += timer() - start
            return out

        return timed

    drafter = peer.drafter
    saved = (mtp._mtp_verify_target, mtp._mtp_acceptance_walk, mtp._MTPVerifyResult.commit)
    mtp._mtp_verify_target = wrap(
        "verify", saved[0], lambda r: [r.hidden, r.target_tokens, r.shared_kv_states]
    )
    mtp._mtp_acceptance_walk = wrap("accept", saved[1], lambda r: [])
    mtp._MTPVerifyResult.commit = wrap("commit", saved[2], lambda r: caches)
    drafter.draft_block = wrap("draft", drafter.draft_block, lambda r: r)
    drafter.accept_verified_tokens = wrap(
        "head_catch_up", drafter.accept_verified_tokens, lambda r: [drafter._seed_token, drafter._seed_hidden]
    )
    try:
        yield
    finally:
        mtp._mtp_verify_target, mtp._mtp_acceptance_walk, mtp._MTPVerifyResult.commit = saved
        del drafter.draft_block, drafter.accept_verified_tokens  # the class's own methods again


def profile_cycles(
    peer: VLMPeer, prompt: list[int], max_tokens: int, k: int, timer: Timer = time.perf_counter
) -> dict[str, Any]:
    """Per-cycle milliseconds of mlx-vlm's single-sequence MTP decode at depth k: each part
    synchronised (see the module rules), `host` the rest of the cycle, and `cycle_unprofiled`
    from a normal run of the same prompt just before."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.models import cache as vlm_cache

    plain = _single(peer, prompt, max_tokens, k, timer)
    caches = vlm_cache.make_prompt_cache(peer.model.language_model)
    totals = dict.fromkeys(PARTS, 0.0)
    ids = mx.array([prompt])
    with _timed(totals, peer, caches, timer):
        steps = generate_step(
            ids,
            peer.model,
            None,
            None,
            max_tokens=max_tokens,
            temperature=0.0,
            prompt_cache=caches,
            **_spec(peer, k),
        )
        first = None
        for _ in steps:
            if first is None:
                first = timer()
        end = timer()
    cycles = max(len(peer.drafter.accept_lens), 1)
    wall = end - (first or end)
    parts = {name: totals[name] / cycles * 1e3 for name in PARTS}
    return {
        "k": k,
        "cycles": cycles,
        "accepted_mean": sum(peer.drafter.accept_lens) / cycles,
        "ms_per_cycle": {
            **parts,
            "host": wall / cycles * 1e3 - sum(parts.values()),
            "cycle": wall / cycles * 1e3,
            "cycle_unprofiled": plain.decode_s / max(plain.cycles, 1) * 1e3,
        },
    }
