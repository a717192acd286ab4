"""The live controller: speculate only while speculation measures faster than plain decode.

(Over 400 lines on purpose: when each event of the controller's machine is due, its
probes, hysteresis and the depth hand-off read together as one schedule. Its modes and
switches are the table in spec/controller.toml (melix_fsm.policy.modes); what it measures
and predicts is melix_fsm.policy.live_estimates; the windows, the depth chooser, the cost
model and its record types (live_types) live in their own modules.)

Rules of this module:
- The mode is the spec's: it changes only through `_send`, one event of
  spec/controller.toml at a time (an event the table lacks raises IllegalTransition);
  this module decides *when* an event is due and what its guards measure.
- Pure and sans-IO: no mlx, no clock. The engine times each decode step and passes the
  seconds to `update`; the controller is a pure function of what it was fed, so two
  ranks fed the same numbers decide the same, and tests drive it with synthetic timings.
- Measured, not predicted. Speculative steps measure tokens/s at the running depth;
  plain steps measure plain tokens/s, both over forgetting windows
  (melix_fsm.policy.throughput). While speculating, a short PLAIN probe now and then measures
  the plain side on the live workload; while suspended, a short SPECULATIVE probe
  measures the other side. Switches need both sides measured; the calibrated cost model
  (melix_fsm.policy.cost_model) is only the prior: it takes the first on/off decision and picks the
  first depth, and it decides alone only for callers that pass no seconds.
- Samples are comparable across batch sizes: each step's tokens are weighted by
  t_1(B) / B from the calibration (1 / B without one), so a plain step that runs exactly
  as calibrated scores 1.0 and a speculative one scores its speedup (B: the batch whose
  plain step the tokens replace, `update`'s `priced_at`).
- Hysteresis: suspend below `suspend_below`, resume above `resume_above`, and no two
  policy switches within `min_dwell` steps; probes back off geometrically while they
  keep confirming the current state.
- A probe must be able to pay: a scheduled probe starts only while the run can still emit
  `probe_min_remaining` tokens (`remaining`, passed by decoders that know their budget).
  Near a run's end its window would cost more than acting on its verdict could return.
  Evidence still acts there: the periodic comparison, and the early plain probe when
  speculation measures clearly behind the calibrated plain.
- Fail closed: a failed or missing calibration under `auto` gives a DISABLED controller
  that never speculates (receipt, stats and behaviour agree). `force_on` never suspends,
  `force_off` never speculates.
- Distributed: a decision taken from wall-clock time differs between ranks. The caller
  passes `agree` (e.g. a broadcast of rank 0's `Decision`), called on every rank at every
  update; the controller adopts what it returns, so every rank drafts the same k.
- The engine reads `speculating` and `k` before each step and applies the returned
  `Action` (suspend / resume rows through lifecycle events) at the cycle boundary. A
  switch to plain made on schedule is announced a step ahead (`plain_due`), so a decoder
  that builds steps ahead builds no cycle that the switch would undo.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from .cost_model import (
    GENERIC_PRIOR,
    AcceptancePrior,
    Timings,
    TimingTable,
    acceptance_rate_of,
)
from .decision import Policy
from .depth import (
    AUTO_MAX_DEPTH,
    DepthChooser,
    DepthDecision,
    DepthEvent,
    DepthReason,
)
from .errors import CalibrationError, PolicyError
from .live_estimates import LiveEstimates
from .live_types import Action, Decision, Estimate, LiveConfig, LiveCounters, LiveEvent, LiveReason
from .modes import CONTROLLER, ON_SIDE, PROBES, SPECULATING, Mode, ModeEvent
from .throughput import PositionAcceptance, Rate


def _table_of(timings: TimingTable | Timings | CalibrationError | None) -> TimingTable | None:
    """The controller's timing table (a single calibration becomes a table of one)."""
    if timings is not None and not isinstance(timings, (TimingTable, Timings, CalibrationError)):
        raise PolicyError(f"live controller: unexpected timings {type(timings).__name__}")
    if isinstance(timings, Timings):
        return TimingTable.of(timings)
    return timings if isinstance(timings, TimingTable) else None


def _max_depth(depth: int | Literal["auto"], max_depth: int | None) -> int:
    """The deepest k the controller may draft: a fixed depth, or auto's ceiling."""
    if depth != "auto" and (type(depth) is not int or depth < 1):
        raise PolicyError(f"live controller: depth must be an int >= 1 or 'auto', got {depth!r}")
    max_k = (max_depth or AUTO_MAX_DEPTH) if depth == "auto" else int(depth)
    if max_k < 1:
        raise PolicyError(f"live controller: max_depth must be >= 1, got {max_k}")
    return max_k


class LiveController(LiveEstimates):
    """Keeps speculation on only while it measures faster than plain decode; picks k.

    timings: the calibration (its prior), the typed failure of one (disabled under auto),
    or None (auto: disabled, not measured; force_on / force_off need none).
    prior: the acceptance prior. depth: a fixed k, or "auto" (1..max_depth, chosen live).
    batch_size: the batch the prior decides for. active: the admission decision
    (`HardwareDecision.speculate`); None lets the prior decide here.
    replay_on_reject: the engine re-runs kept tokens after a rejection on recurrent
    caches; the cost model then prices that replay forward. agree: the distributed hook.
    """

    def __init__(
        self,
        timings: TimingTable | Timings | CalibrationError | None,
        *,
        prior: AcceptancePrior = GENERIC_PRIOR,
        policy: Policy | str = Policy.auto,
        depth: int | Literal["auto"] = 1,
        max_depth: int | None = None,
        batch_size: int = 1,
        active: bool | None = None,
        replay_on_reject: bool = False,
        config: LiveConfig | None = None,
        agree: Callable[[Decision], Decision] | None = None,
    ) -> None:
        self.policy = Policy(policy)
        self.config = cfg = config or LiveConfig()
        self.prior = prior
        self.replay_on_reject = replay_on_reject
        self.agree = agree
        self.failure = timings if isinstance(timings, CalibrationError) else None
        self.table: TimingTable | None = _table_of(timings)
        self._priced: dict[tuple[int, int], Timings] = {}  # table.at(B, k), cached: a per-step cost
        auto_depth = depth == "auto"
        max_k = _max_depth(depth, max_depth)
        self.acceptance = PositionAcceptance(max_k, cfg.acceptance_decay, prior.acceptance)
        self.ema = acceptance_rate_of(prior.acceptance, max_k)
        self.plain = Rate(cfg.decay)
        self._batch_size = batch_size
        first_k = self._prior_depth(batch_size, max_k) if auto_depth else max_k
        self.depth = DepthChooser(
            max_k=max_k,
            initial_k=first_k,
            auto=auto_depth,
            acceptance=self.acceptance,
            decay=cfg.decay,
            config=cfg.depth,
        )
        self.depth_reason = DepthReason.prior if auto_depth else DepthReason.fixed
        self.depth_decision = self._depth_decision(batch_size)
        self.step = 0
        self.events: list[LiveEvent] = []
        self.counters = LiveCounters()
        self.disabled_reason: str | None = None
        self.prompt_acceptance: float | None = None  # what the starting prompts measured (price_prompts)
        if self.policy is Policy.auto and self.table is None:
            self.disabled_reason = self.failure.reason if self.failure else LiveReason.not_measured.value
        if active is None:
            estimate = self._predicted(batch_size, first_k)
            active = estimate is not None and estimate >= 1.0 + cfg.margin
        self._init_schedule(batch_size)
        self._enter_first_mode(bool(active), batch_size)

    def _depth_decision(self, batch_size: int) -> DepthDecision:
        """The first depth and what the cost model predicted at each k (for the receipt)."""
        auto_depth, max_k = self.depth.auto, self.depth.max_k
        return DepthDecision(
            mode="auto" if auto_depth else "fixed",
            k=self.depth.chosen,
            max_k=max_k,
            reason=self.depth_reason,
            predicted_speedup={
                str(k): s
                for k in range(1, max_k + 1)
                if auto_depth and (s := self._predicted(batch_size, k)) is not None
            },
        )

    def _init_schedule(self, batch_size: int) -> None:
        """The machine in `configured`, and when the first probes and verdicts are due."""
        cfg = self.config
        self.mode = CONTROLLER.tracker()  # the spec's machine: every switch is one of its events
        self._probe_timed = self._probe_total = 0
        self._timed = False  # has any timed sample arrived? (else: the cost model alone)
        # the verdict or depth changed at the last update: the next step's period carries the
        # switch (a step launched ahead under the old verdict, undone or computed early)
        self._switched = False
        self._last_switch = 0
        self._plain_wait = cfg.plain_probe_every
        self._spec_wait = cfg.probe_after
        self._next_plain_probe = cfg.first_probe_after
        self._deferred = False  # the first plain probe was put off once already
        self._remaining: int | None = None  # tokens the run can still emit (None: no end in sight)
        self._short: Literal["plain", "spec"] | None = None  # the due probe skipped for want of tokens
        # A probe costs what the losing side loses over its window; on a short run that
        # is a visible share. Probe early only where the prior is in doubt.
        hopeless = self.table is not None and self._perfect_speedup(batch_size) < cfg.resume_above
        self._next_spec_probe = cfg.doubtful_probe_after if hopeless else cfg.first_spec_probe_after
        self._shared: Decision | None = None

    def _enter_first_mode(self, active: bool, batch_size: int) -> None:
        """The first event of the controller's machine: its policy, or the prior's verdict."""
        if self.disabled_reason is not None:
            self._send(ModeEvent.disable, self.disabled_reason)
            self._record(Action.suspend, self.disabled_reason, batch_size)
        elif self.policy is Policy.force_on:
            self._send(ModeEvent.pin_on, "force_on")
        elif self.policy is Policy.force_off:
            self._send(ModeEvent.pin_off, "force_off")
        else:
            reason = LiveReason.prior_admitted if active else LiveReason.prior_disabled
            self._send(ModeEvent.resolve, reason, prior_admits=active)
            if not active:
                self._record(Action.suspend, LiveReason.prior_disabled, batch_size)

    # -- reading -------------------------------------------------------------------
    @property
    def speculating(self) -> bool:
        """Whether the next step drafts (a plain probe says False, a speculative one True)."""
        if self._shared is not None:
            return self._shared.speculating
        return self._own_speculating

    @property
    def _own_speculating(self) -> bool:
        return self.mode.state in SPECULATING

    @property
    def plain_due(self) -> bool:
        """The next update may turn speculation off on schedule: the plain probe due while
        speculating starts, or a speculative probe's window may end. A decoder that builds
        step n + 1 before step n syncs builds no cycle ahead while this holds: a verdict
        for plain at step n's update would undo it, a whole cycle of device work lost. (A
        plain step launched ahead needs no warning: a switch to speculation keeps it as
        the suspended window's last step.) A hint, never a verdict: a verdict off schedule
        (the periodic comparison) still undoes a cycle built ahead."""
        if self._shared is not None:
            return False
        cfg = self.config
        mode = self.mode.state
        if mode is Mode.spec_probe:  # its verdict may come at every `every`-th step of the window
            at_max = self._probe_total + 1 >= cfg.probe_max_steps
            window = self._probe_timed + 1 >= cfg.probe_steps and (self._probe_total + 1) % cfg.every == 0
            return at_max or window
        if mode is Mode.on:
            due = self._timed and self.depth.exploring is None and self.step + 1 >= self._next_plain_probe
            return due and self._long_enough()
        return False

    @property
    def prices_prompts(self) -> bool:
        """Whether `price_prompts` would still take the first decision again: auto with a
        calibration, before the first step (decoders score prompts only while it holds)."""
        return not self.step and self.mode.state in (Mode.on, Mode.suspended) and self.table is not None

    @property
    def k(self) -> int:
        """The depth the next speculative cycle drafts (>= 1)."""
        return self._shared.k if self._shared is not None else self.depth.k

    @property
    def decision(self) -> Decision:
        return Decision(self.speculating, self.k)

    @property
    def disabled(self) -> bool:
        return self.mode.state is Mode.disabled

    @property
    def state(self) -> Mode:
        """The controller's mode (spec/controller.toml)."""
        return self.mode.state

    @property
    def depth_events(self) -> list[DepthEvent]:
        return self.depth.events

    def summary(self) -> dict[str, object]:
        """Plain data for the stats: counters, state, depth, the latest estimate."""
        out: dict[str, object] = msgspec.structs.asdict(self.counters)
        est = self.estimate(self._batch_size)
        out.update(
            policy=self.policy.value,
            state=self.state,
            speculating=self.speculating,
            disabled_reason=self.disabled_reason,
            prompt_acceptance=self.prompt_acceptance,
            ema_acceptance=self.ema,
            per_position_acceptance=self.acceptance.summary(),
            plain_rate=est.plain_rate,
            measured_speedup=est.speedup if est.source.startswith("measured") else None,
            predicted_speedup=est.predicted,
            source=est.source,
            depth_reason=self.depth_reason.value,
            **self.depth.summary(),
        )
        out["k"] = self.k
        return out

    # -- writing -------------------------------------------------------------------

    def price_prompts(self, acceptance: float, batch_size: int) -> Action:
        """Take the first decision again at the acceptance the starting rows' prompts measured.

        acceptance: per draft, over the rows now starting: the sampled rows' prompts scored
        teacher-forced at their own sampling settings (melix_mlx.runtime.prompt_score),
        the family prior for greedy rows. The prior is the checkpoint's greedy figure and
        sampling lowers acceptance, so a sampled start the prior admitted may not pay; the
        prompts say so before a step runs. Only before the first step, under auto, in the
        mode `resolve` chose: once anything was measured the live counters know better,
        and the call changes nothing (Action.keep). auto depth re-picks its first k too.
        """
        if not 0.0 <= acceptance <= 1.0:
            raise PolicyError(f"live controller: prompt acceptance must lie in [0, 1], got {acceptance}")
        if not self.prices_prompts:
            return Action.keep
        before = self.speculating
        self.prompt_acceptance = acceptance
        self.acceptance.prior = acceptance
        self.ema = acceptance_rate_of(acceptance, self.acceptance.max_k)
        if self.depth.rechoose_by_model(self.step, self._cost_fn(batch_size)) is not None:
            self.depth_reason = DepthReason.model
        self.depth_decision = self._depth_decision(batch_size)
        estimate = self._predicted(batch_size, self.depth.k)
        admits = estimate is not None and estimate >= 1.0 + self.config.margin
        self._send(ModeEvent.reprice, LiveReason.prompt_acceptance, prompts_admit=admits)
        if self._own_speculating != before:
            action = Action.resume if admits else Action.suspend
            self._record(action, LiveReason.prompt_acceptance, batch_size, self.estimate(batch_size))
        self._share(batch_size)
        after = self.speculating
        if after == before:
            return Action.keep
        return Action.resume if after else Action.suspend

    def update(
        self,
        batch_size: int,
        accepted: int = 0,
        proposed: int = 0,
        *,
        seconds: float | None = None,
        tokens: int | None = None,
        accepted_per_position: Sequence[int] | None = None,
        exclude: bool = False,
        remaining: int | None = None,
        priced_at: int | None = None,
    ) -> Action:
        """Feed one decode step (a cycle or a plain step); return what to do before the next.

        accepted / proposed: the batch's summed verify outcome (0 / 0 for a plain step).
        seconds: the step's wall-clock time (None: the cost model decides alone).
        tokens: tokens the step emitted over all rows (None: accepted + batch_size).
        accepted_per_position: drafts accepted at positions 1..k, summed over rows.
        exclude: the step overlapped a prefill; count it, do not use its timing. The step
        after a verdict or depth change is excluded the same way: decoders build a step
        before the previous one syncs (mlx-lm's pipelining), so that period carries the
        switch (a step launched under the old verdict and undone, or two steps' compute
        where an eager device ran the launched one at once) and would bias the rates.
        remaining: tokens the run can still emit after this step, at most (a generator's
        longest budget left); None: no end in sight (a queue or a server refills rows). A
        scheduled probe starts only while `probe_min_remaining` tokens are left.
        priced_at: the batch size whose calibrated plain step these tokens replace (None:
        batch_size). A generator draining a fixed batch passes the size it drains from:
        plain would run those rows to their end together, so a token is worth that batch's
        plain cost however few rows are left, and the tail a speculating batch pays (rows
        that drifted apart, finishing at a smaller batch) shows as steps worth little
        (melix_mlx.batch_generator, `objective`).
        """
        self._check(batch_size, accepted, proposed, seconds, tokens, accepted_per_position)
        if priced_at is not None and priced_at < 1:
            raise PolicyError(f"live controller: priced_at must be a batch size >= 1, got {priced_at}")
        if remaining is not None and remaining < 0:
            raise PolicyError(f"live controller: remaining must be >= 0, got {remaining}")
        self._remaining = remaining
        before = self.speculating
        k_before = self.k
        self.step += 1
        self._batch_size = batch_size
        exclude = exclude or self._switched
        drafted, timed = self._observe(
            batch_size,
            accepted,
            proposed,
            seconds,
            tokens,
            accepted_per_position,
            exclude,
            k_before,
            batch_size if priced_at is None else priced_at,
        )
        if not before:
            self.counters.steps_suspended += 1
        mode = self.mode.state
        if mode is Mode.force_on:
            if drafted:
                self.depth.advance(self.step, timed=timed, model_cost=self._cost_fn(batch_size))
        elif mode not in (Mode.disabled, Mode.force_off):
            self._decide(batch_size, drafted, timed)
        if self.mode.state not in PROBES:
            self.depth.settle(self.step)
        self._share(batch_size)
        after = self.speculating
        self._switched = after != before or (after and self.k != k_before)
        if after == before:
            return Action.keep
        return Action.resume if after else Action.suspend

    # -- observing -----------------------------------------------------------------

    # -- deciding ------------------------------------------------------------------
    def _decide(self, batch_size: int, drafted: bool, timed: bool) -> None:
        """auto's step: the events due in the current mode (at most one switch a step)."""
        mode = self.mode.state
        if mode is Mode.plain_probe:
            self._plain_probe_step(batch_size, timed and not drafted)
        elif mode is Mode.spec_probe:
            self._spec_probe_step(batch_size, drafted, timed and drafted)
        elif mode is Mode.on:
            if drafted:
                self.depth.advance(self.step, timed=timed, model_cost=self._cost_fn(batch_size))
            self._while_on(batch_size)
        else:
            self._while_off(batch_size)

    def _send(self, event: ModeEvent, reason: str = "", **guards: bool) -> Mode:
        """Every mode change goes through here: one event of spec/controller.toml. A change
        of side (speculating under auto or not) starts the dwell; a change to the plain
        side ends any depth exploration, and the depth records its loss to plain."""
        before = self.mode.state
        after = self.mode.send(event, str(reason), **guards)
        if before in (Mode.configured, after) or (before in ON_SIDE) == (after in ON_SIDE):
            return after
        self._last_switch = self.step
        if after not in ON_SIDE:
            self.depth.abort()
            self.depth.lost_to_plain(self.step)
        return after

    def _dwelt(self) -> bool:
        return self.step - self._last_switch >= self.config.min_dwell

    def _while_on(self, batch_size: int) -> None:
        cfg = self.config
        due = self._timed and self.depth.exploring is None and self.step >= self._next_plain_probe
        if due and self._probe_pays("plain"):
            est = self.estimate(batch_size)
            ahead = est.source == "measured_spec" and self._above(est, cfg.defer_plain_above)
            if not self._deferred and self._calibrated_at(batch_size) and ahead:
                if self._priced_right(est):
                    # clearly ahead of the calibrated plain: the first plain window can wait (once)
                    self._send(ModeEvent.defer_plain_probe, LiveReason.plain_probe)
                    self._deferred = True
                    self.counters.plain_probes_deferred += 1
                    self._next_plain_probe = self.step + self._plain_wait
                    return
                self.counters.calibration_doubted += 1
            self._start_probe("plain", batch_size)
            return
        if self._behind_calibrated_plain(batch_size):
            # the prior admitted what measures clearly slower than the calibrated plain:
            # measure the plain side now rather than after first_probe_after steps
            self._start_probe("plain", batch_size)
            return
        if self._acceptance_disproves_prior(batch_size):
            # the prior admitted on an acceptance the run does not show: the calibrated cost
            # at the optimistic end of the measured acceptance loses (a run too short for a
            # plain probe cannot wait for one)
            self._send(ModeEvent.suspend, LiveReason.low_acceptance)
            self.counters.suspend_decisions += 1
            self._next_spec_probe = self.step + self._spec_wait
            self._record(Action.suspend, LiveReason.low_acceptance, batch_size, self.estimate(batch_size))
            return
        if self.step % cfg.every or not self._dwelt():
            return
        est = self.estimate(batch_size)
        if est.speedup is None or (self._timed and est.source != "measured"):
            return  # with timings flowing, only a two-sided measurement may switch
        self.counters.evaluations += 1
        if not self._below(est, cfg.suspend_below):
            return
        if est.source == "measured":
            reason = LiveReason.measured_slower
        else:
            k = self.depth.chosen
            perfect = (k + 1) / self.cycle_cost(batch_size, k)
            reason = LiveReason.compute_bound if perfect < cfg.resume_above else LiveReason.low_acceptance
        self._send(ModeEvent.suspend, reason)
        self.counters.suspend_decisions += 1
        self._next_spec_probe = self.step + self._spec_wait
        self._record(Action.suspend, reason, batch_size, est)

    def _behind_calibrated_plain(self, batch_size: int) -> bool:
        """Before the first plain probe: speculation, measured, is clearly below the
        calibrated plain (checked every `every` steps, like the verdicts)."""
        cfg = self.config
        if not self._timed or self.depth.exploring is not None or self.counters.plain_probes:
            return False
        if self.step % cfg.every or not self._calibrated_at(batch_size):
            return False
        est = self.estimate(batch_size)
        return est.source == "measured_spec" and self._below(est, cfg.suspend_below)

    def _acceptance_disproves_prior(self, batch_size: int) -> bool:
        """Before any two-sided measurement: even at the optimistic end of the measured
        acceptance (`PositionAcceptance.optimistic_tokens`), the calibrated cycle cost makes
        speculation slower than plain. Acceptance needs no clock, so a contended machine
        that skews the timings cannot hide it; the calibration's cost ratios price it."""
        cfg = self.config
        if not self._timed or self.counters.plain_probes or self.table is None:
            return False
        if self.counters.probes or self.counters.resume_decisions:
            return False  # on by a measurement (a probe passed, a resume), not by the prior
        if self.depth.exploring is not None or self.step % cfg.every:
            return False  # (no dwell: the prior's admission was no measured switch)
        k = self.depth.chosen
        if self.acceptance.offered[1] < cfg.min_samples * batch_size:
            return False
        best = self.acceptance.optimistic_tokens(k, cfg.z) / self.cycle_cost(batch_size, k)
        return best < cfg.suspend_below

    def _while_off(self, batch_size: int) -> None:
        cfg = self.config
        if self.step >= self._next_spec_probe and self._probe_pays("spec"):
            self._start_probe("spec", batch_size)
            return
        if self.step % cfg.every or not self._dwelt():
            return
        est = self.estimate(batch_size)
        if est.speedup is None or (self._timed and est.source != "measured"):
            return
        self.counters.evaluations += 1
        if self._above(est, cfg.resume_above):
            self._send(ModeEvent.resume, LiveReason.above_threshold)
            self.counters.resume_decisions += 1
            self._next_plain_probe = self.step + self._plain_wait
            self._record(Action.resume, LiveReason.above_threshold, batch_size, est)

    def _long_enough(self) -> bool:
        """The run can still emit `probe_min_remaining` tokens, or has no end in sight."""
        return self._remaining is None or self._remaining >= self.config.probe_min_remaining

    def _probe_pays(self, kind: Literal["plain", "spec"]) -> bool:
        """A due probe may start: enough of the run is left to act on its verdict. A skipped
        probe is counted once, not at every step it stays due (the periodic comparison
        still runs meanwhile)."""
        if self._long_enough():
            self._short = None
            return True
        if self._short != kind:
            self._short = kind
            self.counters.probes_skipped_short += 1
        return False

    def _start_probe(self, kind: Literal["plain", "spec"], batch_size: int) -> None:
        if kind == "plain":
            self._send(ModeEvent.start_plain_probe, LiveReason.plain_probe)
        else:
            self._send(ModeEvent.start_spec_probe, LiveReason.probe)
        self._probe_timed = self._probe_total = 0
        self.depth.abort()
        if kind == "plain":
            self.plain.reset()  # the window is its own evidence
            self.counters.plain_probes += 1
            self._record(Action.suspend, LiveReason.plain_probe, batch_size)
        else:
            self.depth.rates[self.depth.chosen].reset()  # the stale rate is what suspended us
            self.acceptance.reset()
            self.counters.probes += 1
            self._record(Action.resume, LiveReason.probe, batch_size)

    def _probe_progress(self, progressed: bool) -> tuple[bool, bool]:
        """(the minimum window is done, the maximum one is) after this probe step."""
        self._probe_total += 1
        self._probe_timed += progressed
        cfg = self.config
        at_max = self._probe_total >= cfg.probe_max_steps
        return at_max or self._probe_timed >= cfg.probe_steps, at_max

    def _plain_probe_step(self, batch_size: int, timed_plain: bool) -> None:
        done, _ = self._probe_progress(timed_plain)
        if not done:
            return
        cfg = self.config
        est = self.estimate(batch_size)
        self.counters.evaluations += 1
        if est.source != "measured":
            reason = LiveReason.probe_inconclusive
        elif self._below(est, cfg.suspend_below):
            reason = LiveReason.measured_slower
        elif self._above(est, cfg.resume_above):  # clearly faster: probe plain less often
            reason = LiveReason.measured_faster
        elif est.speedup is not None and est.speedup < 1.0:
            # inside the noise but not faster: plain wins the tie (it cannot lose to plain);
            # resuming then needs a speculative probe that is clearly faster
            reason = LiveReason.measured_not_faster
        else:  # inside the noise, at or above 1: speculation stays on (hysteresis), same wait
            reason = LiveReason.measured_tie
        holds = reason not in (LiveReason.measured_slower, LiveReason.measured_not_faster)
        self._send(ModeEvent.end_plain_probe, reason, speculation_holds=holds)
        if not holds:
            self.counters.suspend_decisions += 1
            self._next_spec_probe = self.step + self._spec_wait
            self._record(Action.keep, reason, batch_size, est)
            return
        if reason is LiveReason.probe_inconclusive:
            self.counters.probes_inconclusive += 1
        elif reason is LiveReason.measured_faster:
            self._plain_wait = min(cfg.probe_max_after, math.ceil(self._plain_wait * cfg.probe_backoff))
        self._next_plain_probe = self.step + self._plain_wait
        self._record(Action.resume, reason, batch_size, est)

    def _spec_probe_step(self, batch_size: int, drafted: bool, timed_spec: bool) -> None:
        # untimed callers: the probe observes acceptance, so any drafting step counts
        done, at_max = self._probe_progress(timed_spec if self._timed else drafted)
        if not done:
            return
        cfg = self.config
        est = self.estimate(batch_size)
        usable = est.source in ("measured", "measured_spec") if self._timed else est.source == "model"
        passed = usable and self._above(est, cfg.resume_above)
        # plain wins ties: a probe that does not even measure faster than plain (point
        # estimate below 1) fails at its first look instead of measuring on; only one
        # inside the noise above 1 keeps measuring, up to probe_max_steps
        not_faster = usable and est.speedup is not None and est.speedup < 1.0
        verdict = passed or not_faster or (usable and self._below(est, cfg.resume_above))
        if not at_max and not (verdict and self._probe_total % cfg.every == 0):
            # neither clearly faster nor clearly not: measure on, up to probe_max_steps
            # (looking every few steps, not every step: each look is a chance of a fluke)
            return
        self.counters.evaluations += 1
        if not usable:
            reason = LiveReason.probe_inconclusive
        else:
            reason = LiveReason.probe_passed if passed else LiveReason.probe_failed
        self._send(ModeEvent.end_spec_probe, reason, probe_passed=passed)
        if not usable:
            self.counters.probes_inconclusive += 1
            self._next_spec_probe = self.step + self._spec_wait
            self._record(Action.suspend, reason, batch_size, est)
        elif passed:
            self._spec_wait = cfg.probe_after
            self._next_plain_probe = self.step + self._plain_wait
            self.counters.probes_passed += 1
            self.counters.resume_decisions += 1
            self._record(Action.keep, reason, batch_size, est)
        else:
            # a shallower depth is a new question: its probe comes after the same wait
            if self.depth.lost_to_plain(self.step) is None:
                self._spec_wait = min(cfg.probe_max_after, math.ceil(self._spec_wait * cfg.probe_backoff))
            self._next_spec_probe = self.step + self._spec_wait
            self.counters.probes_failed += 1
            self._record(Action.suspend, reason, batch_size, est)

    def _share(self, batch_size: int) -> None:
        """Adopt rank 0's decision (the `agree` hook); a no-op in a single process."""
        if self.agree is None:
            return
        own = Decision(self._own_speculating, self.depth.k)
        shared = self.agree(own)
        was = self.speculating
        self._shared = None if shared == own else shared
        if self._shared is not None:
            self.counters.shared_overrides += 1
            if shared.speculating != was:
                action = Action.resume if shared.speculating else Action.suspend
                self._record(action, LiveReason.shared_decision, batch_size)

    # -- the prior -----------------------------------------------------------------

    def _record(self, action: Action, reason: str, batch_size: int, est: Estimate | None = None) -> None:
        est = est or Estimate(speedup=None, source="none")
        self.events.append(
            LiveEvent(
                step=self.step,
                action=action,
                reason=str(reason),
                batch_size=batch_size,
                k=self.k,
                speculating=self._own_speculating,
                measured_speedup=est.speedup if est.source.startswith("measured") else None,
                spec_rate=est.spec_rate,
                plain_rate=est.plain_rate,
                predicted_speedup=est.predicted,
                source=est.source,
            )
        )
