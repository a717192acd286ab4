"""The layer caches inside a model's cache list (CacheList containers flattened).

Its own module because the rollback recipes (melix_mlx.runtime.rollback) and the recurrent-state
capture (melix_mlx.runtime.capture) both walk caches and neither should import the other for it.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import CacheList


def leaves(cache: list[Any]) -> list[Any]:
    """Flatten CacheList containers into their layer caches."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(leaves(list(c.caches)))
        else:
            out.append(c)
    return out
