"""Response bodies as JSON text.

Rules: every body and event the server writes is strict JSON (`allow_nan=False`); a
non-finite float (a masked token's -inf logprob) is written as null, never as
`Infinity`, which JSON cannot carry.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(payload: Any) -> str:
    try:
        return json.dumps(payload, allow_nan=False)
    except ValueError:
        return json.dumps(finite(payload), allow_nan=False)
