"""Token checks of one request: where a wrong token sits, and the sampled budget.

Rules of this module:
- `where(t)`: the location part of a wrong-tokens signature. "first token" (the prefill
  path) or "later token" (the decode path), followed by the request's join context when
  it had one, as observed from the outside (`note_joins`, on the step of its first
  token): ", ragged insert" (other requests got their first token in the same step with
  prompts of other lengths: a left-padded prefill) and ", joined running batch" (another
  request had been generating before that step and still was: a join into rows at
  their own offsets). Bugs of different triggers then get different signatures, so a
  known one does not hide the next (melix_fsm.testing.signature.covers); the report
  groups signatures that share a trigger (melix_fsm.testing.qa).
- `check_sampled(t)`: a sampled request (no reference applies) may not get more than
  max_tokens tokens, nor any after a completed stop sequence.
- Pure core: no mlx, no Hypothesis.
"""

from __future__ import annotations

from .mirror import ConformanceError
from .reference import cut_at_stop
from .requests import Tracked


def note_joins(requests: list[Tracked], stepped: list[Tracked]) -> None:
    """Mark the join context of the requests that get their first token in this step."""
    joiners = [t for t in stepped if not t.got]
    if not joiners:
        return
    lengths = {len(t.spec.prompt) for t in joiners}
    running = any(t.got and t.status == "live" for t in requests)
    for t in joiners:
        t.ragged = len(lengths) > 1
        t.joined_running = running


def check_sampled(t: Tracked) -> None:
    """A sampled request: no more than max_tokens tokens, none after a completed stop sequence."""
    if len(t.got) > t.spec.max_tokens:
        raise ConformanceError(
            "sampled_budget",
            f"request #{t.index} (uid {t.uid!r}) got {len(t.got)} tokens {t.got} with max_tokens "
            f"{t.spec.max_tokens}",
            t.uid,
        )
    cut = cut_at_stop(t.got, t.spec.stops)
    if len(cut) < len(t.got):
        raise ConformanceError(
            "sampled_budget",
            f"request #{t.index} (uid {t.uid!r}) got tokens {t.got} past its stop sequence "
            f"(stops {[list(s) for s in t.spec.stops]})",
            t.uid,
        )


def first_difference(t: Tracked) -> int:
    got, want = tuple(t.got), t.expected
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def where(t: Tracked) -> str:
    """The prefill's token or a decoded one, then the request's trigger context (module rules)."""
    text = "first token" if first_difference(t) == 0 else "later token"
    if getattr(t, "ragged", False):
        text += ", ragged insert"
    if getattr(t, "joined_running", False):
        text += ", joined running batch"
    return text


def mismatch(t: Tracked, finished: bool = False) -> str:
    got, want = tuple(t.got), t.expected
    at = first_difference(t)
    how = "finished with" if finished else "has"
    return (
        f"request #{t.index} (uid {t.uid!r}, prompt {list(t.spec.prompt)}, max_tokens {t.spec.max_tokens}, "
        f"stops {[list(s) for s in t.spec.stops]}) {how} tokens {list(got)}, reference {list(want)} "
        f"(first difference at position {at})"
    )
