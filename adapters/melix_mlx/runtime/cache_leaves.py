"""The layer caches inside a model's cache list (CacheList containers flattened).

Its own module because the rollback recipes (melix_mlx.runtime.rollback) and the recurrent-state
capture (melix_mlx.runtime.capture) both walk caches and neither should import the other for it.
The names of the marks a verify puts on cache leaves live here too, so the layer modules
that read them (capture_linear, absorbed_bailing) import no registry module.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import CacheList

ARMED = "melix_steps"  # an armed ArraysCache leaf: list of per-step states (runtime.capture)
VERIFYING = "melix_verifying"  # a KV leaf during a verify forward (runtime.absorbed_mla)


def leaves(cache: list[Any]) -> list[Any]:
    """Flatten CacheList containers into their layer caches."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(leaves(list(c.caches)))
        else:
            out.append(c)
    return out
