"""Serving a sharded model: rank 0 owns the endpoint, every rank runs the same batched steps.

Rules of this module (the rules of melix_mlx.runtime.distributed hold here too):
- Every rank runs mlx-lm's generation loop (melix_mlx.serve.runtime) over its shard of the
  model; only rank 0 runs HTTP. The loop mutates the batch generator in one order on every
  rank: it shares rank 0's decision once per turn (mlx-lm's `_share_object`: a length, then
  the pickled bytes, both `all_sum`s with zeros off rank 0) and each rank applies it.
- What rank 0 decides is a `Command`: at most one new request (the request without its
  local cancel flag, and its generation arguments: each rank tokenizes it and builds the
  same sampler and processors), the uids cancelled since the last turn, and shutdown.
  mlx-lm's loop shares its own removals (`uids_to_remove`); sampled, drafted and accepted
  tokens are rank 0's through `Agreement` inside each step. A turn runs `STEPS_PER_TURN`
  steps (fewer when the batch has nothing to do) instead of mlx-lm's time budget, which
  syncs the ranks' clocks with a collective every turn: a count of steps needs none.
- Cancellation: a client's cancel flips a flag on rank 0 at any time, so no rank reads
  that flag in a step. A cancellation counts from the turn whose command carries it
  (`ServingBatchGenerator.committed`), on every rank alike.
- The loop shares a turn at least every 0.1 s while idle (mlx-lm's queue timeout), and
  beats at every turn and after every batched step: a step (one cycle, or one prefill of
  the joining rows) is the unit the bound applies to, never a whole turn of
  `STEPS_PER_TURN` steps, which on a loaded CPU outlasts a short bound while every rank
  progresses in lockstep. A `Watchdog` per rank ends the rank when its loop has not come
  back from a step's collectives within `rank_timeout_s` (a peer died or hung); a peer
  that died may show sooner, as a ring error raised by the step. Either way the rank is
  lost: on rank 0 every open request fails with `rank_lost` (503, or an error event in a stream) and the
  server exits 4; a follower prints its typed line and exits 4.
- Shutdown is a command too: after rank 0's drain, its `stop` shares `shutdown`, every
  loop ends at the same turn, and the followers exit 0. A follower given SIGTERM/SIGINT
  waits for that command at most `drain_timeout_s` plus a grace, then exits 4.
- A step's error ends the server (`fatal_errors`): ranks that disagree cannot go on.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty
from typing import Any

import mlx.core as mx

from ..runtime.distributed import EXIT_RANK_FAILED, DistributedError, PeerLost, rank_error
from .prompt_work import PrefillBudget
from .request_queue import RequestCancelled, SpeculativeContext
from .runtime import ServingResponseGenerator

RANK_TIMEOUT_S = 60.0  # a collective that has not returned by then: a rank died or hung
SIGNAL_GRACE_S = 10.0  # past the drain timeout, a signalled follower stops waiting for rank 0
STEPS_PER_TURN = 8  # batched steps between two turns, on every rank (no clock decides it)


@dataclass(frozen=True)
class Command:
    """Rank 0's decisions since the last turn (see the module rules)."""

    request: tuple[Any, Any] | None = None  # (portable request, GenerationArguments)
    cancels: tuple[int, ...] = ()
    shutdown: bool = False


def portable(request: Any) -> Any:
    """The request without its cancel flag (a lock cannot cross ranks; see the rules)."""
    out = copy.copy(request)
    if hasattr(out, "cancelled"):
        out.cancelled = None
    return out


def restored(request: Any) -> Any:
    """The request as the loop sees it on every rank: a flag of its own, never set."""
    out = copy.copy(request)
    if hasattr(out, "cancelled"):
        out.cancelled = threading.Event()
    return out


class Sink:
    """A follower's response queue: rank 0 answers the client, nothing reads this one."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, SpeculativeContext):
            item.queue = self


class Watchdog:
    """Calls `on_timeout` once when no `beat` came for `bound_s` seconds."""

    def __init__(self, bound_s: float, on_timeout: Callable[[], None]) -> None:
        self.bound_s = bound_s
        self.on_timeout = on_timeout
        self.last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="melix-rank-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(0.5, self.bound_s / 4)):
            if time.monotonic() - self.last > self.bound_s:
                self.on_timeout()
                return


class DistributedResponseGenerator(ServingResponseGenerator):
    """The served generation loop on one rank of a sharded model (see the module rules)."""

    def __init__(self, *args: Any, rank_timeout_s: float = RANK_TIMEOUT_S, **kwargs: Any) -> None:
        group = mx.distributed.init()
        self.rank, self.ranks = group.rank(), group.size()
        self.rank_timeout_s = rank_timeout_s
        self.lost: DistributedError | None = None
        self._on_lost: Callable[[DistributedError], None] | None = None
        self._lost_lock = threading.Lock()
        self._committed: set[int] = set()
        self._stopping = False
        self._local: Any = None  # rank 0: the response queue of the request being shared
        self.watchdog = Watchdog(rank_timeout_s, self._hung)
        self.watchdog.start()
        super().__init__(*args, **kwargs)  # starts the generation thread

    @property
    def _time_budget(self) -> Any:
        return range(STEPS_PER_TURN)

    @_time_budget.setter
    def _time_budget(self, _: Any) -> None:  # mlx-lm's, which syncs its clock with a collective
        pass

    # -- one turn: rank 0 decides, every rank applies -------------------------------
    def _next_request(self, timeout: float | None = None) -> Any:
        self.memory_trim.tick()  # every rank returns its own free memory (serve.memory)
        self.watchdog.beat()
        command = self._decide(timeout) if self.rank == 0 else None
        command = self._share_object(command)
        self.watchdog.beat()
        return self._apply(command)

    def _decide(self, timeout: float | None) -> Command | None:
        request = None
        if not self._stopping:
            with contextlib.suppress(Empty):
                queue = self.requests
                request = queue.get(timeout=timeout) if timeout is not None else queue.get_nowait()
        if request is not None and request[1].cancelled is not None and request[1].cancelled.is_set():
            request[0].put(RequestCancelled("cancelled while queued"))  # never shared: no rank saw it
            request = None
        contexts = list(self.contexts.items())
        cancels = tuple(u for u, ctx in contexts if ctx.cancelled and u not in self._committed)
        if request is None and not cancels and not self._stopping:
            return None
        self._local = request[0] if request is not None else None
        shared = (portable(request[1]), request[2]) if request is not None else None
        return Command(shared, cancels, self._stopping)

    def _apply(self, command: Command | None) -> Any:
        if command is None:
            return None
        for uid in command.cancels:
            ctx = self.contexts.get(uid)
            if ctx is not None:
                self._committed.add(uid)
                ctx.stop()
        if command.shutdown:
            self._stop = True
            return None
        if command.request is None:
            return None
        request, args = command.request
        rqueue = self._local if self.rank == 0 else Sink()
        self._taken = rqueue
        return rqueue, restored(request), args

    def _make_batch_generator(self, model: Any, **options: Any) -> Any:
        generator = super()._make_batch_generator(model, **options)
        generator.committed = self._committed
        generator.fatal_errors = True
        generator.heartbeat = self.watchdog.beat  # the bound is per step (see the rules)
        generator.budget = PrefillBudget(None, self.prefill_chunk)  # fixed chunks: the same cuts on each rank
        return generator

    # -- the loop, its end, its loss ---------------------------------------------------
    def _generate(self) -> None:
        try:
            self._loop(self)  # no restart: a fresh loop on one rank would leave the others behind
        except Exception as exc:  # a ring error or a failed step: this rank is lost
            logging.exception("rank %d: the generation loop failed", self.rank)
            self._lose(rank_error(exc, self.rank, "the generation loop: "))
        finally:
            self.watchdog.stop()

    def _hung(self) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where this rank waits
        message = f"a collective did not return within {self.rank_timeout_s:g} s: a rank died or hung"
        self._lose(PeerLost(message, rank=self.rank))

    def _lose(self, error: DistributedError) -> None:
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = error
            self._stop = True
            handler = self._on_lost
        if handler is not None:
            handler(error)

    def bind(self, on_lost: Callable[[DistributedError], None]) -> None:
        """Call `on_lost` (once, from any thread) when this rank is lost; at once if it is."""
        with self._lost_lock:
            self._on_lost = on_lost
            lost = self.lost
        if lost is not None:
            on_lost(lost)

    def generation_available(self) -> bool:
        return self.lost is None and super().generation_available()

    def stop(self, timeout: float) -> None:
        """Rank 0: share `shutdown` at the loop's next turn and wait for it (bounded)."""
        if self.lost is not None:  # the loop ended, or waits in a collective that cannot return
            return
        self._stopping = True
        self.wait(min(timeout, self.rank_timeout_s))

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the loop to end; whether it still runs."""
        self._generation_thread.join(timeout)
        return self._generation_thread.is_alive()


def fatal_line(error: DistributedError) -> str:
    return json.dumps(error.as_json())


def exit_lost(error: DistributedError) -> None:
    """End this rank with its typed line and status 4.

    os._exit: the generation thread (not a daemon) may be blocked inside an mlx collective
    that will never return; a normal exit would wait for it forever.
    """
    print(fatal_line(error), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_RANK_FAILED)


def follow(generator: DistributedResponseGenerator, *, drain_timeout_s: float) -> int:
    """A follower's main thread: wait for the loop to end (rank 0's shutdown), bounded after a signal."""
    generator.bind(exit_lost)
    deadline: list[float] = []

    def on_signal(signum: int, frame: Any) -> None:  # rank 0 decides the drain; wait for its shutdown
        if not deadline:
            logging.info("rank %d: signal %d; waiting for rank 0's shutdown", generator.rank, signum)
            deadline.append(time.monotonic() + drain_timeout_s + SIGNAL_GRACE_S)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while generator.wait(0.25):
        if deadline and time.monotonic() > deadline[0]:
            exit_lost(PeerLost("rank 0 sent no shutdown after the signal", rank=generator.rank))
    if generator.lost is not None:
        exit_lost(generator.lost)
    return 0
