"""A test-double MTP head that drafts from a script, to exercise the acceptance path.

Random tiny heads accept almost nothing, so the accept / partial-accept / rollback paths
of the decoders need a head whose drafts are right on purpose.

Rules:
- The head's cache is a real mlx-lm cache (``make_cache() -> [KVCache()]``; the batched
  generator merges those into a ``BatchKVCache``). It stores the token ids the head was
  fed as keys and values, shape ``[B, 1, L, 1]`` float32 (exact for ids < 2**24). So the
  head sees exactly what the decoder fed it, primed, caught up and rolled back: at each
  call it rebuilds every row's token context from the cache (``BatchKVCache`` rows
  start at their ``left_padding``; rolled-back holes are skipped) and looks the
  next-next token up in its table. A
  decoder that forgets to prime or catch up, or rolls the head cache back wrongly, sees
  its acceptance collapse.
- Slot convention (docs/engine.md, head pairs): pair i feeds token t_{i+1} and predicts t_{i+2}; the
  cache thus holds t_1, t_2, ... and the prediction after context ``c`` is the token
  that follows ``c`` in a script with its first token removed. The table maps every
  prefix of ``script[1:]`` to its next token; an unknown prefix predicts token 0.
- ``wrong_every=m`` makes the prediction deliberately wrong ((right + 1) % vocab) when
  ``len(prefix) % m == 0``, forcing rejections and rollbacks at known places.
- Returns ``(logits [B, L, V] one-hot-ish float32, head_hidden [B, L, D] zeros)``: the
  scripted token gets logit ``confidence`` (default 50: q is one-hot for any sampler),
  every other token 0. A small ``confidence`` gives a spread q for sampling tests.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


class ScriptedHead:
    """Drafts the scripted continuation; see the module rules."""

    def __init__(
        self,
        scripts: list[list[int]],
        vocab_size: int,
        hidden_size: int,
        wrong_every: int | None = None,
        *,
        confidence: float = 50.0,
    ) -> None:
        self.vocab_size = vocab_size
        self.confidence = confidence
        self.hidden_size = hidden_size
        self.wrong_every = wrong_every
        self.calls = 0
        self.table: dict[tuple[int, ...], int] = {}
        for script in scripts:
            seen = list(script[1:])
            for m in range(1, len(seen)):
                self.table.setdefault(tuple(seen[:m]), seen[m])

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def predict(self, prefix: list[int]) -> int:
        token = self.table.get(tuple(prefix), 0)
        if self.wrong_every and len(prefix) % self.wrong_every == 0:
            token = (token + 1) % self.vocab_size
        return token

    def __call__(
        self, hidden: mx.array, next_tokens: mx.array, cache: list[Any] | None = None
    ) -> tuple[mx.array, mx.array]:
        self.calls += 1
        B, L = next_tokens.shape
        ids = next_tokens.astype(mx.float32)[:, None, :, None]
        if cache is None:
            cache = self.make_cache()
        c = cache[0]
        keys, _ = c.update_and_fetch(ids, ids)
        rows = keys[:, 0, :, 0].astype(mx.int32).tolist()
        starts = c.left_padding.tolist() if isinstance(c, BatchKVCache) else [0] * B
        holes = getattr(c, "holes", None)  # rows rolled back without moving data
        holes = holes.tolist() if holes is not None else None
        targets = []
        for b in range(B):
            dropped = holes[b] if holes else []
            context = [
                t for p, t in enumerate(rows[b]) if p >= starts[b] and not (p < len(dropped) and dropped[p])
            ]
            before = len(context) - L
            targets.append([self.predict(context[: before + i + 1]) for i in range(L)])
        onehot = mx.array(targets)[..., None] == mx.arange(self.vocab_size)
        logits = onehot.astype(mx.float32) * self.confidence
        return logits, mx.zeros((B, L, self.hidden_size), mx.float32)
