"""Prometheus metrics of one server (GET /metrics), with prometheus_client.

Rules of this module:
- One `ServeMetrics` per server, on its own `CollectorRegistry` (two servers in one
  process never share counters).
- The generation thread is the only writer: `observe_step` after every generator step
  reads the step's lifecycle report (melix_fsm.report.StepReport) — drafts proposed,
  drafts accepted, tokens emitted — and the rows' states; `observe_rows` after a removal.
  Policy decisions are read from the live controller's own counters at scrape time, so
  they never disagree with the controller.
- Requests are counted by their final state (finished, cancelled, failed) and the
  requests in flight are a gauge; the event loop writes those two.
- Tokens/s is measured over a sliding window of recent steps (wall time between steps),
  not predicted.
- Prefill segments (one step's prompt work, melix_mlx.serve.prompt_work) are timed by the
  generation thread: their count, total seconds and the longest (`observe_segment`). So
  are the parts of a streamed token's gap: each whole step, its admission and the loop's
  work between two steps (`Durations`: a histogram and its longest).
- The prompt cache is read at scrape time (`watch_prompt_cache`): its entries and bytes
  beside their configured bounds, so a soak can check that it stays bounded.
- The process's memory by layer (mlx's allocator, malloc, Python, the resident set) is
  read at scrape time too (melix_mlx.serve.memory).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from melix_fsm import lifecycle as lc
from melix_fsm.lifecycle import State

from .memory import MemoryCollector, gauge

WINDOW_S = 5.0  # tokens/s is measured over the steps of the last WINDOW_S seconds
SEGMENT_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"



class Durations:
    """A histogram of seconds and its longest observation (`<name>_max`): the latency
    bench bounds gaps by the longest, which a histogram's buckets do not give."""

    def __init__(self, name: str, what: str, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(name, f"Seconds of {what}", buckets=SEGMENT_BUCKETS, registry=registry)
        self.longest = Gauge(f"{name}_max", f"The longest of {what}", registry=registry)

    def observe(self, seconds: float) -> None:
        self.histogram.observe(seconds)
        if seconds > self.longest._value.get():
            self.longest.set(seconds)

class _PolicyCollector:
    """The live controller's decision counters, read when scraped."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Any]:
        decisions = CounterMetricFamily(
            "melix_policy_decisions", "Device-policy decisions of the live controller", labels=["decision"]
        )
        speculating = GaugeMetricFamily(
            "melix_policy_speculating", "1 while the live policy lets rows speculate, else 0"
        )
        counters = getattr(self.controller, "counters", None)
        if counters is not None:
            decisions.add_metric(["suspend"], counters.suspend_decisions)
            decisions.add_metric(["resume"], counters.resume_decisions)
            speculating.add_metric([], 1.0 if self.controller.speculating else 0.0)
        yield decisions
        yield speculating


class _PromptCacheCollector:
    """The prompt cache's size and bounds (mlx-lm's LRUPromptCache), read when scraped."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Any]:
        for name, text, value in (
            ("melix_prompt_cache_entries", "Prompts held by the prompt cache", len(self.cache)),
            ("melix_prompt_cache_max_entries", "The prompt cache's entry bound", self.cache.max_size),
            ("melix_prompt_cache_bytes", "Bytes held by the prompt cache", self.cache.nbytes),
            ("melix_prompt_cache_max_bytes", "The prompt cache's byte bound", self.cache.max_bytes),
        ):
            yield gauge(name, text, value)


class ServeMetrics:
    def __init__(self, controller: Any = None, method: str = "mtp") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.proposed = Counter("melix_speculative_proposed_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("melix_speculative_accepted_tokens", "Draft tokens accepted", registry=r)
        self.rejected = Counter("melix_speculative_rejected_tokens", "Draft tokens rejected", registry=r)
        self.generated = Counter("melix_generated_tokens", "Tokens generated (all rows)", registry=r)
        self.prompt_tokens = Counter("melix_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.failures = Counter("melix_request_failures", "Requests ended by an error", registry=r)
        self.requests = Counter(
            "melix_requests", "Accepted requests by their final state", ["state"], registry=r
        )
        self.in_flight = Gauge("melix_requests_in_flight", "Accepted requests not ended yet", registry=r)
        for state in ("finished", "cancelled", "failed"):
            self.requests.labels(state=state)
        self.acceptance = Gauge(
            "melix_speculative_acceptance_rate",
            "Accepted over verified drafts since start (NaN before)",
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "melix_generation_tokens_per_second", f"Tokens/s over the last {WINDOW_S:g} s", registry=r
        )
        self.rows = Gauge("melix_batch_rows", "Rows in the batch, by lifecycle state", ["state"], registry=r)
        self.peak_rows = Gauge("melix_batch_rows_peak", "Most rows decoded together since start", registry=r)
        self.segments = Durations("melix_prefill_segment_seconds", "each prefill segment stage", r)
        # where a streamed token's gap goes: the generator's step, its admission, the loop between steps
        self.steps = Durations("melix_step_seconds", "each generator step (decode, segments, admission)", r)
        self.admissions = Durations("melix_admission_seconds", "each step's admission of joining prompts", r)
        self.between_steps = Durations("melix_between_steps_seconds", "the loop's work between two steps", r)
        self.info = Gauge(
            "melix_speculation_method", "1 for the method this server decodes with", ["method"], registry=r
        )
        self.info.labels(method=method).set(1)
        self.acceptance.set(float("nan"))
        for state in ("speculating", "suspended", "plain"):
            self.rows.labels(state=state).set(0)
        r.register(_PolicyCollector(controller))
        r.register(MemoryCollector())
        self._window: deque[tuple[float, int]] = deque()
        self._verified = [0, 0]  # accepted, accepted + rejected
        self._counters: dict[Any, Any] = {}  # uid -> its lifecycle counters at the last report
        self.peak = 0

    def observe_step(self, report: Any, tokens: int, prompt_tokens: int, rows: Any) -> None:
        """One step's report: the lifecycle's own counters per row (their change since the
        last report), never effects recomputed from the events."""
        for row in report.rows:
            if row.counters is None:
                continue
            before = self._counters.get(row.uid)
            proposed = row.counters.proposed - (before.proposed if before else 0)
            accepted = row.counters.accepted - (before.accepted if before else 0)
            rejected = row.counters.rejected - (before.rejected if before else 0)
            self.proposed.inc(proposed)
            self.accepted.inc(accepted)
            self.rejected.inc(rejected)
            self._verified[0] += accepted
            self._verified[1] += accepted + rejected
            self._counters[row.uid] = row.counters
        for uid in report.left:  # a row that left reports no more
            self._counters.pop(uid, None)
        if self._verified[1]:
            self.acceptance.set(self._verified[0] / self._verified[1])
        self.generated.inc(tokens)
        self.prompt_tokens.inc(prompt_tokens)
        now = time.monotonic()
        self._window.append((now, tokens))
        while self._window and now - self._window[0][0] > WINDOW_S:
            self._window.popleft()
        span = now - self._window[0][0] if len(self._window) > 1 else 0.0
        counted = sum(n for _, n in list(self._window)[1:])
        self.tokens_per_second.set(counted / span if span > 0 else 0.0)
        self.observe_rows(rows)

    @property
    def tracked_rows(self) -> int:
        """Rows whose counters are held (for their next report's change)."""
        return len(self._counters)

    def forget(self, uids: Any) -> None:
        """Rows removed outside a step (cancelled) are in no report's `left`: their counters go."""
        for uid in uids:
            self._counters.pop(uid, None)

    def observe_segment(self, seconds: float) -> None:
        self.segments.observe(seconds)

    def watch_prompt_cache(self, cache: Any) -> None:
        self.registry.register(_PromptCacheCollector(cache))

    def observe_rows(self, rows: Any) -> None:
        counts = {"speculating": 0, "suspended": 0, "plain": 0}
        for row in rows:
            if row.state is State.suspended:
                counts["suspended"] += 1
            elif row.state in lc.CYCLE_READY:  # refused and faulted rows are never cycle-ready
                counts["speculating"] += 1
            else:
                counts["plain"] += 1
        for state, n in counts.items():
            self.rows.labels(state=state).set(n)
        self.peak = max(self.peak, sum(counts.values()))
        self.peak_rows.set(self.peak)

    def render(self) -> bytes:
        return generate_latest(self.registry)
