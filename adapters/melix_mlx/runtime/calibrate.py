"""Timed forwards of a loaded model and its MTP head, for melix_fsm.policy.calibration.

Rules of this module:
- Each timed callable runs exactly one forward of the shape the decode loop runs at batch
  size B: a 1-token decode step, a (k+1)-token verify, or one head draft step (head call
  on one slot, then argmax). It forces its outputs with mx.eval and puts the caches back
  where they were (KV trimmed, recurrent layers restored from a `rollback.CacheMark`), so
  every run sees the same cache length.
- Its tokens are distinct ids, as text is, drawn from a fixed key (every run and every
  rank times the same forwards): a MoE routes each token to its own experts, and one
  repeated id in every row and position reads a fraction of the experts a real verify
  reads (identical rows read the same experts). Measured with 64 experts, top 8: a
  repeated id priced t_verify / t_1 at 2.12 (batch 1) and 1.08 (batch 4) where distinct
  ids cost 2.38 and 1.57 (benchmarks/bench_calibration_ids.py). `FORWARDS` names this
  choice in the calibration cache's key, so figures timed otherwise are not reused.
- Caches are prefilled with a short prompt first (and the head's cache primed from its
  (hidden, next token) pairs), so attention runs over a realistic, non-empty cache.
- Calibrate before serving, never beside a running prefill: samples taken while another
  forward competes poison the measured policy (seen in the field: a verdict that flips).
- Under mx.distributed every rank runs the same forwards (tensor-parallel collectives
  need all ranks), then `agree` replaces every rank's figures by rank 0's, so all ranks
  take the same on/off decision and verify shapes never diverge.
- Every failure while building or timing comes back as a typed `CalibrationError`.
- Batch sizes calibrated together are checked against each other, and in one process a
  poisoned or contradicting size is measured once more (`policy.calibration.measure_table`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm.policy.calibration import (
    DEFAULT_BUDGET_S,
    DEFAULT_RUNS,
    DEFAULT_WARMUP,
    measure,
    measure_table,
)
from melix_fsm.policy.cost_model import Timings, TimingTable
from melix_fsm.policy.errors import CalibrationError

from ..loading.errors import UnsupportedModel
from . import absorbed_mla, capture, layer_kv, rollback
from .hidden import forward_with_hidden, main_parts

Forward = Callable[[], None]
PROMPT_LEN = 16
FORWARDS = "distinct-ids"  # what the timed forwards are fed (the calibration cache's key)
_IDS_SEED = 20261207
_MAX_ID = 1 << 15  # ids stay in the range every real vocabulary uses for text


def _vocab_size(model: nn.Module) -> int:
    """How many ids the model embeds (its embedding table's rows); small ids otherwise."""
    try:
        return int(main_parts(model).embed_tokens.weight.shape[0])
    except (UnsupportedModel, AttributeError):  # a stand-in model (tests) embeds what it is fed
        return 2 + PROMPT_LEN


def token_ids(model: nn.Module, shape: tuple[int, ...], salt: int) -> mx.array:
    """Distinct-looking ids in [1, vocab) from a fixed key: the same on every call and rank."""
    high = min(_vocab_size(model), _MAX_ID)
    return mx.random.randint(1, high, shape, key=mx.random.key(_IDS_SEED + salt)).astype(mx.int32)


def build_forwards(
    model: nn.Module,
    head: Any,
    *,
    batch_size: int = 1,
    k: int = 1,
    prompt_len: int = PROMPT_LEN,
    cache: list[Any] | None = None,
    head_cache: list[Any] | None = None,
) -> tuple[Forward, Forward, Forward]:
    """(fn_1, fn_verify, fn_head) for `model` and `head` at batch size B and depth k.

    `cache` / `head_cache`: empty caches to use (fresh ones by default; tests pass their
    own to check that the lengths stay fixed).
    """
    B = batch_size
    prompt = token_ids(model, (B, prompt_len), 0)  # rows differ, as a batch's do
    cache = make_prompt_cache(model) if cache is None else cache
    _, hidden = forward_with_hidden(model, prompt, cache)
    layer_kv.adopt(cache, model)  # DeepSeek-V4.1's layer caches roll back in their spare form, as decoding's
    mx.eval(hidden, [c.state for c in rollback.leaves(cache)])
    start = rollback.mark(cache)

    step_tokens = token_ids(model, (B, 1), 1)
    verify_tokens = token_ids(model, (B, k + 1), 2)

    def fn_1() -> None:
        logits, h = forward_with_hidden(model, step_tokens, cache)
        mx.eval(logits, h)
        rollback.restore(cache, start)

    # the verify as the engine runs it: decode-shaped layer variants, recurrent states captured
    capture.install(model)
    absorbed_mla.install(model)

    def fn_verify() -> None:
        armed = capture.arm(cache)
        marked = absorbed_mla.arm(rollback.leaves(cache))
        logits, h = forward_with_hidden(model, verify_tokens, cache)
        steps = capture.collect(armed)
        absorbed_mla.disarm(marked)
        mx.eval(logits, h, steps)
        rollback.restore(cache, start)

    head_cache = head.make_cache() if head_cache is None else head_cache
    _, primed = head(hidden[:, :-1], prompt[:, 1:], head_cache)  # prime like the decoder does
    mx.eval(primed)
    last_hidden = hidden[:, -1:]

    def fn_head() -> None:
        logits, head_hidden = head(last_hidden, step_tokens, head_cache)
        mx.eval(mx.argmax(logits[:, -1], axis=-1), head_hidden)
        rollback.trim_all(head_cache, 1)

    return fn_1, fn_verify, fn_head


def calibrate(
    model: nn.Module,
    head: Any,
    *,
    batch_sizes: Sequence[int] = (1,),
    k: int = 1,
    runs: int = DEFAULT_RUNS,
    warmup: int = DEFAULT_WARMUP,
    budget_s: float = DEFAULT_BUDGET_S,
    timer: Callable[[], float] = time.perf_counter,
    group: Any = None,
    context: int | Mapping[int, int] = PROMPT_LEN,
) -> TimingTable | CalibrationError:
    """Measure at each batch size; a table of rank 0's figures, or the typed failure.

    `budget_s` bounds the whole calibration: each measurement gets what the previous ones
    left. `group`: an mx.distributed group to agree over (None: this process alone).
    `context`: tokens already in the cache when timing (attention grows with it; a bench
    calibrates at its prompts' length), one for all batch sizes or one per batch size.
    In one process a poisoned measurement, or batch sizes whose figures contradict each
    other, are measured once more (`melix_fsm.policy.calibration.measure_table`).

    Under a group of several ranks every rank runs every forward (a rank that stopped
    early on its own clock would leave the others waiting in a collective), so nothing is
    re-measured: the budget is checked once, on rank 0's clock, after the measurement,
    and agreed like the rest.
    """
    start = timer()
    deadline = start + budget_s
    together = group is not None and group.size() > 1

    def measure_at(B: int) -> Timings:
        left = math.inf if together else deadline - timer()
        if left <= 0:
            raise CalibrationError("measurement_timeout", f"budget {budget_s:g} s spent before B={B}")
        tokens = context if isinstance(context, int) else context[B]
        try:
            fns = build_forwards(model, head, batch_size=B, k=k, prompt_len=tokens)
        except Exception as exc:  # a model that cannot even prefill is a failed measurement
            raise CalibrationError(
                "measurement_failed", f"building forwards at B={B}: {type(exc).__name__}: {exc}"
            ) from exc
        return measure(
            *fns, k=k, batch_size=B, runs=runs, warmup=warmup, timer=timer, budget_s=left, note="mtp_head"
        )

    result: TimingTable | CalibrationError
    try:
        result = measure_table(measure_at, batch_sizes, retry=not together)
        if together and timer() > deadline:
            spent = f"{timer() - start:.3g} s spent, budget {budget_s:g} s"
            raise CalibrationError("measurement_timeout", spent)
    except CalibrationError as exc:
        result = exc
    return agree(result, group, batch_sizes=batch_sizes, k=k, runs=runs)


_REASON_CODES = {0: None, 1: "measurement_failed", 2: "measurement_timeout", 3: "measurement_poisoned"}


def agree(
    result: TimingTable | CalibrationError,
    group: Any = None,
    *,
    batch_sizes: Sequence[int] = (1,),
    k: int = 1,
    runs: int = DEFAULT_RUNS,
) -> TimingTable | CalibrationError:
    """Give every rank rank 0's result (identity in a single process).

    Every rank must call this with the same batch sizes, k and runs, whatever its own
    result: the collectives below run unconditionally on every rank, so no rank can
    leave the group waiting. Status and figures travel as float32 vectors summed over
    the group with zeros off rank 0.
    """
    if group is None or group.size() == 1:
        return result
    rank0 = group.rank() == 0
    if isinstance(result, TimingTable):
        code = 0
        by_b = {t.batch_size: t for t in result.entries}
        fields = [v for b in batch_sizes for v in _figures(by_b.get(b))]
    else:
        code = next(c for c, r in _REASON_CODES.items() if r == result.reason)
        fields = [0.0] * (4 * len(batch_sizes))
    status = mx.distributed.all_sum(mx.array([float(code) if rank0 else 0.0]), group=group)
    vec = mx.array([v if rank0 else 0.0 for v in fields], dtype=mx.float32)
    summed = mx.distributed.all_sum(vec, group=group).tolist()
    code0 = int(status.item())
    if code0:
        own = result.detail if isinstance(result, CalibrationError) else ""
        detail = _rank0_text(own, group)  # the receipt quotes it: the same text on every rank
        return CalibrationError(_REASON_CODES[code0], detail)  # type: ignore[arg-type]
    entries = [
        Timings(
            t_1=summed[4 * i],
            t_verify=summed[4 * i + 1],
            t_head=summed[4 * i + 2],
            spread=summed[4 * i + 3],
            k=k,
            batch_size=b,
            runs=runs,
            note="rank 0",
        )
        for i, b in enumerate(batch_sizes)
    ]
    return TimingTable.of(*entries)


_TEXT_BYTES = 512


def _rank0_text(text: str, group: Any) -> str:
    """Rank 0's text (UTF-8, up to _TEXT_BYTES bytes) on every rank."""
    raw = text.encode()[:_TEXT_BYTES] if group.rank() == 0 else b""
    codes = mx.array(list(raw.ljust(_TEXT_BYTES, b"\0")), dtype=mx.int32)
    summed = mx.distributed.all_sum(codes, group=group).tolist()
    return bytes(summed).rstrip(b"\0").decode(errors="replace")


def _figures(t: Timings | None) -> tuple[float, float, float, float]:
    return (0.0, 0.0, 0.0, 0.0) if t is None else (t.t_1, t.t_verify, t.t_head, t.spread)


def model_dtype(model: nn.Module) -> str:
    """The floating dtype the model computes in (quantized weights report their scales')."""
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"


def device_kind() -> str:
    return "cpu" if mx.default_device().type == mx.cpu else "gpu"
