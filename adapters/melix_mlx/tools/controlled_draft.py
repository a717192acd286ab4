"""A draft source with controlled acceptance: the target's own greedy token with probability p.

Used to measure the speculative cycle's efficiency for any family without a trained head
(benchmarks/bench_controlled_acceptance.py).

Rules of this module:
- `ControlledDraft` wraps a family's real head: every call runs the head's own forward
  (its trunk at every slot, its output projection on the last one; read at one slot, the
  head's own `at_slot` work), so a cycle pays what it pays with a trained head; only the
  proposal is replaced.
- The proposal at slot j (the head is fed token t_{j+1} and predicts t_{j+2}) is the
  target's greedy token, looked up from a plain greedy run made first (`scripts`: each
  prompt followed by mlx-lm's greedy continuation), with probability p, and a token that
  is certainly wrong ((right + 1) mod V) otherwise. Draws are independent per slot and
  call, seeded: drafted position i is then accepted with probability p^i.
- Nothing is read back to the host inside a call: the slot's sequence position comes from
  a position cache (an mlx-lm KVCache next to the head's own caches, whose offset counts
  the row's live entries: prime, catch-up and rollback move it as they move the head's),
  the lookup is a gather in a [positions, V] table, the draws come from a per-call key.
  So the source adds no synchronisation the engine would not have.
- The table is keyed by (position, fed token). Rows of a batch whose scripts share a
  token at the same position with different continuations collide (a later script's
  entry wins); the benches report the acceptance they measured, not p.
- A head that drafts steps >= 1 through ``chain_step`` (deepseek_v41's block drafter: its
  hidden is a per-slot seed ``(position, token)``) is wrapped there too: the head's own
  chain step runs (its cost paid), and draft step i reads the table at the seed's slot + i.
- Greedy identity holds whatever the proposals: the verify decides every emitted token.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


class ControlledDraft:
    """The real head's forward with proposals drawn right with probability p; see the rules."""

    def __init__(self, head: Any, scripts: list[list[int]], vocab_size: int, p: float, seed: int = 0) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.head = head
        self.vocab_size = vocab_size
        self.p = p
        self.seed = seed
        self.calls = 0
        if isinstance(head, nn.Module):  # the head's verify-shaped forms (latent attention)
            from ..runtime import absorbed_mla

            absorbed_mla.install(head)
        length = max(len(s) for s in scripts)
        table = [[-1] * vocab_size for _ in range(length)]
        for script in scripts:
            for j in range(len(script) - 2):
                table[j][script[j + 1]] = script[j + 2]
        self.positions = length
        self.table = mx.array(table, dtype=mx.int32)  # [positions, V]: -1 where unknown

    def make_cache(self) -> list[Any]:
        return [*self.head.make_cache(), KVCache()]

    @property
    def chain_step(self) -> Any:
        """The wrapped head's chain step, controlled; None for a head that chains whole."""
        return self._chain_step if getattr(self.head, "chain_step", None) is not None else None

    def _chain_step(self, step: int, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        real, out = self.head.chain_step(step, hidden, tokens)
        B = tokens.shape[0]
        positions = hidden[:, -1:, 0].astype(mx.int32) + step  # the seed's slot, then one per step
        return self._proposal(positions, tokens.reshape(B, 1), real), out

    def _proposal(self, positions: mx.array, tokens: mx.array, real: mx.array) -> mx.array:
        """One-hot logits [B, L, V] of the right token (probability p) or a wrong one."""
        B, L = tokens.shape
        right = self.right_tokens(mx.broadcast_to(positions, (B, L)), tokens)
        key = mx.random.key(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        take = mx.random.uniform(shape=(B, L), key=key) < self.p
        want = mx.where(take, right, (right + 1) % self.vocab_size)
        onehot = (want[..., None] == mx.arange(self.vocab_size)).astype(mx.float32)
        # the real projection stays in the graph, so its cost is paid as a trained head's
        return onehot * 100.0 + 0.0 * real[:, -1:].astype(mx.float32)

    def right_tokens(self, positions: mx.array, tokens: mx.array) -> mx.array:
        """The target's greedy token after (position, fed token) slots; 0 where the run ended."""
        inside = positions < self.positions
        flat = mx.clip(positions, 0, self.positions - 1) * self.vocab_size + tokens.astype(mx.int32)
        found = mx.take(self.table.reshape(-1), flat)
        return mx.where(inside & (found >= 0), found, 0)

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None, mask: Any = None
    ) -> tuple[mx.array, mx.array]:
        if cache is None:
            cache = self.make_cache()
        B, L = next_tokens.shape
        head = self.head
        if hasattr(head, "trunk"):
            head_hidden = head.trunk(hidden, next_tokens, cache[:-1], mask)
            real = head.logits(head_hidden[:, -1:])
        else:
            real, head_hidden = head(hidden, next_tokens, cache[:-1], mask)
        positions = self._advance(cache[-1], B, L) + mx.arange(L)[None]  # [B or 1, L]: the slots' entries
        return self._proposal(positions, next_tokens, real), head_hidden

    def at_slot(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any], at: mx.array
    ) -> tuple[mx.array, mx.array]:
        """(logits [B, V], head_hidden [B, 1, D]) at slot `at` [B, 1, 1], as the wrapped head's
        own `at_slot` computes them (its cost), with the proposal read at that slot."""
        at_head = getattr(self.head, "trunk_at", None)
        if at_head is None:
            logits, out = self(hidden, next_tokens, cache)
            return mx.take_along_axis(logits, at, axis=1)[:, 0], mx.take_along_axis(out, at, axis=1)
        B, L = next_tokens.shape
        head_hidden = at_head(hidden, next_tokens, cache[:-1], at)
        real = self.head.logits(head_hidden)
        slot = at.reshape(-1, 1)
        positions = self._advance(cache[-1], B, L) + slot
        tokens = mx.take_along_axis(next_tokens, slot, axis=1)
        return self._proposal(positions, tokens, real)[:, 0], head_hidden

    @staticmethod
    def _advance(where: KVCache, B: int, L: int) -> mx.array:
        """Count L slots into the position cache; the first one's entry index [B or 1, 1]."""
        before = where.offset
        where.update_and_fetch(mx.zeros((B, 1, L, 1)), mx.zeros((B, 1, L, 1)))
        return mx.array(before).reshape(-1, 1) if not isinstance(before, mx.array) else before.reshape(-1, 1)
