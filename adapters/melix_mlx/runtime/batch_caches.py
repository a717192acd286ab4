"""The engine's batch cache forms, from a fresh mlx-lm merge of row caches.

Rules of this module:
- mlx-lm merges row caches into `BatchKVCache` / `BatchRotatingKVCache` leaves. The
  engine rolls rows back per row, so every such leaf takes its exact form in place before
  a verify runs: a sliding window its ragged window form (melix_mlx.runtime.window_batch),
  then every plain batch KV leaf its ragged form (melix_mlx.runtime.ragged_kv).
- Here, not in either module, because the window form is a ragged cache: one module
  importing the other both ways would be an import circle.
"""

from __future__ import annotations

from typing import Any

from . import ragged_kv, window_batch


def adopt(cache: list[Any]) -> list[Any]:
    """The exact batch forms of a merged cache's leaves (in place; returns `cache`)."""
    window_batch.adopt(cache)
    return ragged_kv.adopt(cache)
