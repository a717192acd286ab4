"""Single-sequence MTP speculative decoding on mlx-lm's real forwards.

Rules of this module:
- Output identity: greedy output equals mlx-lm's `generate_step` token for token, and
  sampled output has mlx-lm's sampling distribution (melix_mlx.sampling). The target
  model decides every emitted token; drafts only decide how many come per forward.
- Every draft, verify, accept/rollback, plain step and fault is a transition of the
  sequence's lifecycle machine (melix_fsm.lifecycle); its counters are the statistics.
- Head-slot convention (DESIGN.md): pair i joins the main model's post-norm hidden h_i
  with token t_{i+1} and predicts t_{i+2}. The head's cache holds one entry per pair
  the main model has confirmed. Pairs not yet fed to the head wait in `_pending_*` and
  ride along with the next draft forward, so priming from the prompt and catching up
  after each verify cost no extra head call. Chained drafts (k > 1) add k - 1
  speculative entries that are trimmed after the verify.
- Rollback is exact (melix_mlx.rollback): trimmable caches are trimmed; caches with
  recurrent layers are restored to the pre-verify checkpoint and the kept tokens are
  replayed (counted in `replay_forwards`).
- An exception inside the head or the verify forward moves the sequence to faulted: the
  caches are restored, the pending drafts are dropped, and decoding continues plainly
  from the last confirmed token. No token is lost; the fault is counted and its
  message kept in `fault_message`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from melix_fsm import lifecycle as lc
from melix_fsm.lifecycle import SequenceMachine, State
from melix_fsm.policy import Action

from . import rollback
from .hidden import forward_with_hidden
from .prefill import prefill_with_hidden
from .sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    normalize_logits,
    params_of,
    probabilities,
    sample_from,
)

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]

_CYCLE_READY = frozenset({State("admitted"), State("accepted"), State("rolled_back")})
_NO_POLICY = frozenset({State("refused"), State("faulted"), State("finished")})  # never speculate again


class MTPDecoder:
    """Decode one sequence with an MTP head; see the module rules.

    Use `generate(prompt, max_tokens)`, which yields `(token, logprobs, from_draft)`
    like mlx-lm's `speculative_generate_step`. `machine.counters` and the forward
    counts are the statistics.
    """

    def __init__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        *,
        num_draft_tokens: int = 1,
        sampler: Sampler | None = None,
        logits_processors: list[LogitsProcessor] | None = None,
        prompt_cache: list[Any] | None = None,
        prefill_step_size: int = 2048,
        machine: SequenceMachine | None = None,
        refusal: str | None = None,
        controller: Any = None,
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.head = head
        self.k = num_draft_tokens
        self.sampler = sampler
        self.params: SamplingParams | None = params_of(sampler)
        self.processors = list(logits_processors or [])
        self.cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
        self.head_cache = head.make_cache() if head is not None else None
        self.prefill_step_size = prefill_step_size
        self.machine = machine if machine is not None else SequenceMachine(uid=0)
        self.target_forwards = 0  # verify and plain forwards, prefill excluded
        self.replay_forwards = 0  # extra forwards that rebuilt recurrent state
        self.head_forwards = 0
        self.fault_message: str | None = None
        self.refusal = refusal or self._refusal_reason()
        self.controller = controller  # melix_fsm.policy.ActivationController, or None: always on
        self._history: list[int] = []  # every token fed to the model, for processors
        self._pending_hidden: mx.array | None = None  # [L, D] hiddens awaiting the head
        self._pending_tokens: list[int] = []  # the token paired with each pending hidden

    # -- admission ---------------------------------------------------------------
    def _refusal_reason(self) -> str | None:
        if self.head is None:
            return "no MTP head loaded"
        if self.params is None:
            return "unknown sampler: its distribution cannot be verified losslessly"
        bad = rollback.unsupported_kinds(self.cache)
        if bad:
            return f"cache kinds without exact rollback: {', '.join(bad)}"
        return None

    def _resolve(self) -> None:
        if self.machine.state is lc.INITIAL:
            reason = self.refusal or ""
            self.machine.send(lc.Signal(event=(lc.REFUSE if self.refusal else lc.ADMIT).event, reason=reason))
        elif self.refusal and self.machine.allows(lc.SUSPEND.event):
            # Admitted before loading (by a receipt), refused by what only the loaded
            # decoder knows (sampler, cache kinds): pause for good, with the reason.
            self.machine.send(lc.Signal(event=lc.SUSPEND.event, reason=self.refusal))
            self.controller = None

    # -- target side ---------------------------------------------------------------
    def _target(self, logits: mx.array, fed: list[int] | None) -> mx.array:
        """Processed log-probabilities [L, V] for logits [L, V] of the tokens `fed`.

        The token history exists only for logits processors; without them `fed` may be
        None, which lets a cycle keep its drafts on the device until one final sync.
        """
        if self.processors:
            rows = []
            for i, token in enumerate(fed):
                self._history.append(token)
                row = logits[i : i + 1]
                history = mx.array(self._history)
                for processor in self.processors:
                    row = processor(history, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return normalize_logits(logits)

    def _choose(self, logprobs: mx.array) -> mx.array:
        """The target's token(s) for processed log-probabilities, as mlx-lm samples them."""
        if self.sampler is None:
            return mx.argmax(logprobs, axis=-1)
        return self.sampler(logprobs)

    def _forget(self, n: int) -> None:
        if n > 0 and self.processors:
            del self._history[-n:]

    # -- head side -----------------------------------------------------------------
    def _queue_pairs(self, hidden: mx.array, tokens: list[int]) -> None:
        if self.head is None or self.machine.state is State("faulted"):
            return
        if self._pending_hidden is None:
            self._pending_hidden = hidden
        else:
            self._pending_hidden = mx.concatenate([self._pending_hidden, hidden], axis=0)
        self._pending_tokens.extend(tokens)

    def _draft(self, k: int) -> tuple[mx.array, mx.array | None]:
        """Feed pending pairs, then chain; returns k drafts [k] (lazy) and their q (sampling only)."""
        assert self.head is not None and self.head_cache is not None
        hidden = self._pending_hidden[None]
        tokens = mx.array(self._pending_tokens)[None]
        self._pending_hidden, self._pending_tokens = None, []
        drafts: list[mx.array] = []
        qs: list[mx.array] = []
        for _ in range(k):
            logits, head_hidden = self.head(hidden, tokens, self.head_cache)
            self.head_forwards += 1
            last = logits[0, -1:]
            if self.params.greedy:
                token = mx.argmax(last, axis=-1)
            else:
                q = probabilities(normalize_logits(last), self.params)
                qs.append(q)
                token = sample_from(q)
            drafts.append(token)
            # chain on the head's own output; the token stays on the device (no sync)
            hidden, tokens = head_hidden[:, -1:], token[None]
        return mx.concatenate(drafts), (mx.concatenate(qs, axis=0) if qs else None)

    # -- steps -----------------------------------------------------------------------
    def _prefill(self, prompt: mx.array) -> tuple[mx.array, mx.array]:
        """Feed the prompt; return processed log-probs [1, V] of its last position and all hiddens."""
        logits, hiddens = prefill_with_hidden(self.model, prompt, self.cache, self.prefill_step_size)
        tokens = prompt.tolist()
        if self.processors:
            self._history.extend(tokens[:-1])
        return self._target(logits, tokens[-1:]), hiddens

    def _plain_step(self, y: int) -> tuple[int, mx.array]:
        logits, h = forward_with_hidden(self.model, mx.array([[y]]), self.cache)
        self.target_forwards += 1
        logprobs = self._target(logits[0], [y])
        token = int(self._choose(logprobs).item())
        self._queue_pairs(h[0], [token])
        self.machine.send(lc.PLAIN_STEP)
        return token, logprobs[0]

    def _fault(self, exc: BaseException) -> None:
        self.fault_message = f"{type(exc).__name__}: {exc}"
        self.machine.send(lc.Signal(event=lc.FAULT.event, reason=self.fault_message))
        self._pending_hidden = None
        self._pending_tokens = []

    def _cycle(self, y: int, k: int) -> list[tuple[int, mx.array, bool]] | None:
        """One draft -> verify -> accept/rollback cycle; None when it faulted."""
        try:
            draft_arr, q = self._draft(k)
            # processors need the drafts' values for their history; otherwise stay lazy
            drafts = draft_arr.tolist() if self.processors else None
        except Exception as exc:  # a broken head must not cost the sequence a token
            self._fault(exc)
            return None
        self.machine.send(lc.draft(k))
        cp = rollback.checkpoint(self.cache)
        self.machine.send(lc.VERIFY)
        history_len = len(self._history)
        try:
            inputs = mx.concatenate([mx.array([y], dtype=draft_arr.dtype), draft_arr])[None]
            logits, hidden = forward_with_hidden(self.model, inputs, self.cache)
            self.target_forwards += 1
            logprobs = self._target(logits[0], None if drafts is None else [y, *drafts])
            if self.params.greedy:
                targets_arr = self._choose(logprobs)
                mx.eval(targets_arr, draft_arr)  # the cycle's one sync
                targets, drafts = targets_arr.tolist(), draft_arr.tolist()
                a = accept_greedy(drafts, targets)
                bonus = targets[a]
            else:
                drafts = draft_arr.tolist()
                a, bonus = accept_sampled(drafts, q, probabilities(logprobs, self.params))
        except Exception as exc:
            rollback.restore(self.cache, cp)
            del self._history[history_len:]
            self._fault(exc)
            return None
        self.machine.send(lc.verified(a))
        fed = [y, *drafts]
        self._forget(k - a)
        if rollback.rollback(self.cache, cp, fed=k + 1, keep=a + 1):
            _, hidden = forward_with_hidden(self.model, mx.array([fed[: a + 1]]), self.cache)
            self.replay_forwards += 1
        rollback.trim_all(self.head_cache, k - 1)  # the chained, speculative head entries
        self._queue_pairs(hidden[0, : a + 1], [*drafts[:a], bonus])
        out = [(d, logprobs[i], True) for i, d in enumerate(drafts[:a])]
        out.append((bonus, logprobs[a], False))
        return out

    def generate(self, prompt: mx.array, max_tokens: int = 256) -> Iterator[tuple[int, mx.array, bool]]:
        """Yield up to `max_tokens` tokens as `(token, logprobs, from_draft)`."""
        self._resolve()
        if self.controller is not None and not self.controller.speculating:
            self._apply(Action.suspend)  # the gate disabled this start: begin suspended
        logprobs, hiddens = self._prefill(prompt)
        y = int(self._choose(logprobs[-1:]).item())
        self._queue_pairs(hiddens, [*prompt[1:].tolist(), y])
        produced = 1
        yield y, logprobs[-1], False
        while max_tokens < 0 or produced < max_tokens:
            remaining = max_tokens - produced if max_tokens >= 0 else self.k + 1
            before = (self.machine.counters.accepted, self.machine.counters.proposed)
            if self.machine.state in _CYCLE_READY:
                k = max(1, min(self.k, remaining - 1))
                out = self._cycle(y, k)
                if out is None:
                    continue  # faulted: the next iteration decodes y plainly
            else:
                token, lp = self._plain_step(y)
                out = [(token, lp, False)]
            if self.controller is not None and self.machine.state not in _NO_POLICY:
                c = self.machine.counters
                self._apply(self.controller.update(1, c.accepted - before[0], c.proposed - before[1]))
            for item in out[:remaining]:
                produced += 1
                yield item
            y = out[-1][0]

    def _apply(self, action: Action) -> None:
        """Turn a controller action into a lifecycle event, when the state allows it."""
        if action is Action.keep:
            return
        event = lc.SUSPEND if action is Action.suspend else lc.RESUME
        if self.machine.allows(event.event):
            reason = self.controller.events[-1].reason if self.controller.events else action.value
            self.machine.send(lc.Signal(event=event.event, reason=str(reason)))

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of the lifecycle machine plus forward counts, as plain data."""
        out = self.machine.counters.summary()
        out.update(
            state=self.machine.state.value,
            target_forwards=self.target_forwards,
            replay_forwards=self.replay_forwards,
            head_forwards=self.head_forwards,
            refusal=self.refusal,
            fault=self.fault_message,
            policy=self.controller.summary() if self.controller is not None else None,
        )
        return out
