"""Prompt work off the decode path: tokenization before the queue, prefill within a time budget.

Rules of this module:
- Tokenization (the chat template and the encoding) runs on the HTTP side, on one
  tokenizer thread per server (`Tokenizing`), before the request is admitted: the
  generation thread never tokenizes, and an empty or too long prompt is refused (400)
  before it takes a place in the queue. The generation thread takes the tokens as given
  (`ServedRequest.tokenized`); a sharded server's ranks receive them with the request.
- Each generator step spends at most about `budget_s` of prefill on queued prompts
  (`PrefillBudget`), whether rows decode or not: a pending segment longer than what the
  budget allows is cut, and the rest waits for the next step, between the running rows'
  decode steps. A prompt that prefills alone is cut too: a request that arrives meanwhile
  waits for at most one budget, and a piece's cost grows with the context (a 256-token
  piece took ~2 s at 2k tokens of context on the embedded model, ~30x its cost at 0), so
  no fixed token count is safe. What the budget allows is measured, not assumed: each
  request's own prompt tokens per second on its latest piece (the cost follows its
  context), a piece at most twice its latest (the cost per token is not flat in the piece's
  size: measured on a small piece, a large one overshoots); a request not measured yet gets
  a probe of `PROBE` tokens, unless it starts from an empty cache and a join has been
  measured: then the join's rate prices it (`PrefillBudget.fresh`), under the same
  doubling rule counted in the tokens the join attended to. Joins measure it (their
  admission timed, when every joining piece followed at most `PROBE` tokens of context):
  a short prompt that fits then joins whole in one step instead of first sending a probe
  through the segment stage and waiting a step for it (measured beside a 20k-token
  prefill: with a 32-token probe a ~45-token request waited about two segments). Pieces share
  the budget between the requests of a step, but a share is not cut below a probe (each
  piece is a forward of its own: tiny ones cost more in overhead than they save, and a
  rate measured on them falls, so they would stay tiny), unless the whole budget holds
  less. A
  piece is never shorter than `MIN_PIECE` tokens (progress) nor longer than the chunk
  limit (`prefill_chunk`).
- A segment stage shares its step's budget with the admission that follows it: the
  prompts ready to join are priced at the latest join's rate and their seconds come off
  the segments' budget, so a step's prompt work (segments and joins) stays near the
  budget and a running stream's gap with it (measured before: admissions of 37 ms mean,
  150 ms at most, on top of full segments).
- The last piece of a prompt (prefilled when its row joins the batch) is cut to its share
  at each step too: a longer final piece gives its head to the segment stage
  (`PrefillBudget.cut`), so joining costs at most one piece, whatever the rate was when
  the request was inserted (melix_mlx.serve.chunks cuts it once, at insertion).
- A step in which a short prompt (one that fits its piece) joins skips the segment stage
  (`BudgetedPrefill`), every other step at most (a stream of arrivals cannot stall a long
  prompt): a step's tokens, the joining row's first one included, reach the clients only
  when the whole step returns, so a segment in the joining step would delay that first
  token by a segment (measured: running the segment after the join in the same step,
  on what the join left of the budget, gave a 20k-prompt run's short requests a median
  TTFT of 2.2 segments).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.server import ResponseGenerator

from melix_fsm.errors import MelixError

PROBE = 32  # tokens of a request's first piece, before any measurement of it
MIN_PIECE = 1  # the fewest tokens a piece prefills: progress, however long the context


class PromptRejected(MelixError, ValueError):
    """The tokenized prompt is empty or longer than the server's limit (a 400)."""


def tokens(generator: Any, tokenizer: Any, request: Any, args: Any) -> tuple:
    """mlx-lm's tokenization of a request (its `_tokenize`); image parts through mlx-vlm's
    processor (melix_mlx.serve.images), refused typed where the model takes none."""
    from .images import tokenize as with_images

    return with_images(generator, tokenizer, request, args) or ResponseGenerator._tokenize(
        generator, tokenizer, request, args
    )


def tokenize(generator: Any, tokenizer: Any, request: Any, args: Any) -> tuple:
    """`tokens`, checked against the server's prompt limit."""
    out = tokens(generator, tokenizer, request, args)
    prompt, limit = out[0], getattr(request, "max_prompt_tokens", 0)
    if not len(prompt):
        raise PromptRejected("the prompt is empty after tokenization")
    if limit and len(prompt) > limit:
        raise PromptRejected(f"the prompt has {len(prompt)} tokens; this server accepts at most {limit}")
    return out


class Tokenizing:
    """One server's tokenizer thread (see the module rules)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="melix-tokenize")

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class PrefillBudget:
    """How many prompt tokens a step may prefill within `budget_s` (see the module rules)."""

    def __init__(self, budget_s: float | None, chunk: int) -> None:
        self.budget_s = budget_s
        self.chunk = chunk
        self.rates: dict[int, tuple[float, int]] = {}  # uid -> its latest piece: tokens/s, tokens
        self.fresh: tuple[float, int] | None = None  # the latest measured join: tokens/s, tokens attended
        self._planned: dict[int, int] = {}  # uid -> tokens of this step's piece

    def piece(
        self, uid: int | None = None, share: float = 1.0, *, fresh: bool = False, within: float | None = None
    ) -> int:
        """The tokens a piece of request `uid` may hold within `share` of the budget (or of
        `within` seconds); `fresh`: the request starts from an empty cache (a join's rate
        prices it)."""
        if self.budget_s is None:  # no budget: fixed chunks
            return self.chunk
        measured = self.rates.get(uid) if uid is not None else None
        if measured is None and fresh:
            measured = self.fresh
        if measured is None:  # not measured yet: a probe (another request's rate says little of it)
            return max(MIN_PIECE, min(PROBE, self.chunk))
        rate, latest = measured  # a piece at most doubles: a cost per token that is not flat overshoots
        whole = int(rate * (self.budget_s if within is None else within))  # the budget to itself
        shared = max(int(whole * share), min(PROBE, whole))  # a share is never cut below a probe
        return max(MIN_PIECE, min(self.chunk, 2 * latest, shared))

    def cut(self, queue: Any, limit: int, reserve_s: float = 0.0) -> list[Any]:
        """The requests the next segment stage prefills (at most `limit`), each next segment
        cut to its share of the budget less `reserve_s` (the step's admissions); a final
        piece longer than its share gives its head to the segment stage (see the module rules)."""
        if self.budget_s is None:
            pending = [r for r in queue if r.segments][:limit]
            self._planned = {r.uid: len(r.segments[0]) for r in pending}
            return pending
        queued = {r.uid for r in queue}
        self.rates = {uid: rate for uid, rate in self.rates.items() if uid in queued}  # joined or gone
        pending = [r for r in queue if r.segments or len(r.prompt) > self.piece(r.uid, fresh=is_fresh(r))]
        pending = pending[:limit]
        for request in pending:
            left = max(self.budget_s - reserve_s, 0.0)
            tokens = self.piece(request.uid, 1.0 / len(pending), fresh=is_fresh(request), within=left)
            if not request.segments:  # the final piece: its head is prefilled now
                request.segments.append(list(request.prompt[:tokens]))
                request.prompt = request.prompt[tokens:]
            head = request.segments[0]
            if len(head) > tokens:
                request.segments[0:1] = [head[:tokens], head[tokens:]]
        self._planned = {r.uid: len(r.segments[0]) for r in pending}
        return pending

    def observe(self, seconds: float) -> None:
        """The seconds the segment stage took for the pieces `cut` planned."""
        planned, self._planned = self._planned, {}
        tokens = sum(planned.values())
        if tokens <= 0 or seconds <= 0:
            return
        for uid, n in planned.items():  # each piece had its share of the step's time
            self.rates[uid] = (n * len(planned) / seconds, n)

    def admission_s(self, tokens: int) -> float:
        """The seconds a join of `tokens` fresh prompt tokens is expected to take (0 before
        any join was measured)."""
        return tokens / self.fresh[0] if self.fresh is not None and tokens else 0.0

    def observe_join(self, tokens: int, attended: int, seconds: float) -> None:
        """A join's admission: `tokens` prefilled in `seconds`, the longest row `attended` tokens
        (context and piece); it prices the first piece of prompts from an empty cache."""
        if tokens > 0 and seconds > 0:
            self.fresh = (tokens / seconds, attended)


def is_fresh(request: Any) -> bool:
    """A queued request that has prefilled nothing and holds no cached prefix."""
    return not request.all_tokens and request.cache is None


class Clock:
    """Seconds of one stretch of work (a context manager)."""

    def __enter__(self) -> Clock:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start


class BudgetedPrefill:
    """The serving batch generator's segment stage and admission, ordered by the budget (see
    the module rules); mixed into melix_mlx.serve.runtime.ServingBatchGenerator, whose
    `budget` (PrefillBudget) and `metrics` it uses."""

    _yielded = False  # the previous step gave its segment stage to joining prompts

    def _prefill_segments(self) -> list[PromptProcessingBatch.Response]:
        """The segment stage within the step's time budget (see the module rules): skipped
        in a step in which a short prompt joins, every other step at most."""
        if self._joining() and not self._yielded:
            self._yielded, self._held = True, set()
            return []
        self._yielded = False
        # the prompts this step admits after the segment stage share its budget
        free = min(self.completion_batch_size - len(self.batch), self.prefill_batch_size)
        reserve = self.budget.admission_s(sum(len(r.prompt) for r in self._fitting()[: max(free, 0)]))
        pending = self.budget.cut(self._queue, self.prefill_batch_size, reserve_s=reserve)
        with Clock() as clock:
            responses = super()._prefill_segments()
        self.budget.observe(clock.seconds)
        if pending:
            self.metrics.observe_segment(clock.seconds)
        return responses

    def _joining(self) -> bool:
        """A queued prompt joins in this step's admission, within one piece, while others wait
        for the segment stage (a time budget only: ranks cut the same chunks every step)."""
        if self.budget.budget_s is None or self.steps.ahead is not None:
            return False
        if len(self.batch) >= self.completion_batch_size or not any(r.segments for r in self._queue):
            return False
        return bool(self._fitting())

    def _fitting(self) -> list[Any]:
        """The queued prompts whose rest fits one piece: the admission takes them."""
        piece = self.budget.piece
        return [r for r in self._queue if not r.segments and len(r.prompt) <= piece(r.uid, fresh=is_fresh(r))]

    def _admit(self, out: list[Any]) -> list[PromptProcessingBatch.Response]:
        """Admission, timed: a join of rows with (almost) no context measures the rate that
        prices fresh prompts' first pieces (see the module rules)."""
        contexts = {r.uid: len(r.all_tokens) for r in self._queue}
        tokens_before = self.prompt_tokens
        with Clock() as clock:
            responses = super()._admit(out)
        if responses:
            self.metrics.admissions.observe(clock.seconds)
        joined = [r for r in responses if r.uid in contexts and r.end_of_prompt]
        if self.budget.budget_s is not None and joined and all(contexts[r.uid] <= PROBE for r in joined):
            attended = max(r.progress[1] for r in joined)
            self.budget.observe_join(self.prompt_tokens - tokens_before, attended, clock.seconds)
        return responses
