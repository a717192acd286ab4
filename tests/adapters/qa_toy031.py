"""A toy mlx-lm 0.31-style target for `melix-fsm qa`, for a simulated mlx-lm 0.31 environment.

Rules of this file:
- `SequenceStateMachine` copies mlx-lm 0.31.3's constructor semantics: `transitions`
  must be a mapping (`SequenceStateMachine(None)` raises AttributeError there, the kit's
  old false alarm), and no transitions mean no stops. The test installs it as
  `mlx_lm.generate.SequenceStateMachine` while it hides the 0.32-only symbols.
- `factory` builds `Toy031`: a 0.31-shaped surface (`insert(prompts, max_tokens=None,
  state_machines=None)`, `next`, `remove`) over mlx-lm's BatchGenerator without stop
  sequences; it applies each request's state-machine stops itself (the stopping token
  is kept, as mlx-lm does). It takes the model and the checkpoint path, as a fork's
  factory would.
- Imports only names mlx-lm 0.31 has (BatchGenerator, make_sampler).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler


class SequenceStateMachine:
    def __init__(self, transitions: Any = {}, initial: str = "normal") -> None:  # noqa: B006  (0.31.3's)
        self._initial = initial
        self._states: dict[str, Any] = {}
        for src, edges in transitions.items():  # None -> AttributeError, as in 0.31.3
            sequences, dst = zip(*edges)
            self._states[src] = (list(sequences), dst)
        if not self._states:
            self._states[initial] = ([], [])

    def stops(self) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self._states[self._initial][0]]


class Toy031:
    def __init__(self, model: Any, temperature: float) -> None:
        self.inner = BatchGenerator(
            model, sampler=make_sampler(temp=temperature), prefill_batch_size=2, completion_batch_size=3
        )
        self.stops: dict[int, list[tuple[int, ...]]] = {}
        self.recent: dict[int, tuple[int, ...]] = {}

    def insert(
        self, prompts: list[list[int]], max_tokens: list[int] | None = None, state_machines: Any = None
    ) -> list[int]:
        uids = self.inner.insert(prompts, max_tokens)
        for i, uid in enumerate(uids):
            machine = state_machines[i] if state_machines else None
            self.stops[uid] = machine.stops() if machine is not None else []
            self.recent[uid] = ()
        return uids

    def next(self) -> list[Any]:
        out = []
        for r in self.inner.next()[1]:
            if r.uid not in self.stops:  # stopped by its state machine already
                continue
            token = int(r.token)
            self.recent[r.uid] = (self.recent[r.uid] + (token,))[-8:]
            reason = r.finish_reason
            if any(self.recent[r.uid][-len(s) :] == s for s in self.stops[r.uid] if s):
                reason = "stop"
            out.append(SimpleNamespace(uid=r.uid, token=token, finish_reason=reason))
            if reason is not None:
                if r.finish_reason is None:
                    self.inner.remove([r.uid])
                del self.stops[r.uid]
        return out

    def remove(self, uids: list[int]) -> None:
        self.inner.remove(uids)
        for uid in uids:
            self.stops.pop(uid, None)


def factory(model: Any, checkpoint: str, temperature: float = 0.0) -> Any:
    assert checkpoint  # a fork's factory would load its own model from it
    return Toy031(model, temperature)
