"""The `speculative` object nested in a response's `usage`.

Rules: built from the finishing row's own counters (melix_fsm.counters via the batch
generator's final response), never estimated. `method` is the served method ("mtp" or
"draft_model") when the row could draft and "none" otherwise, with the reason (the
receipt's refusal, the row's refusal or fault, or the plain path an unbatchable model
takes).
`position_proposed[p]` counts the cycles that drafted position p + 1, so its length is
the depth the row drafted to. Clients that do not know the key ignore it.
"""

from __future__ import annotations

from typing import Any

PLAIN_PATH_REASON = "this model's caches cannot be batched: requests are decoded one at a time, without MTP"


def speculative_usage(
    stats: dict[str, Any] | None, refusal: str | None = None, method: str = "mtp"
) -> dict[str, Any]:
    stats = stats or {}
    reason = stats.get("refusal") or refusal
    out: dict[str, Any] = {
        "method": "none" if reason else method,
        "proposed": int(stats.get("proposed", 0)),
        "accepted": int(stats.get("accepted", 0)),
        "rejected": int(stats.get("rejected", 0)),
        "acceptance_rate": stats.get("acceptance_rate"),
        "mean_acceptance_length": stats.get("mean_acceptance_length"),
        "cycles": int(stats.get("cycles", 0)),
        "suspended_steps": int(stats.get("suspended_steps", 0)),
        "position_proposed": [int(n) for n in stats.get("position_proposed", [])],
    }
    if reason:
        out["reason"] = reason
    if stats.get("fault"):
        out["fault"] = stats["fault"]
    return out
