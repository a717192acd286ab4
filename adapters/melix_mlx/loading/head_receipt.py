"""The receipt a loaded head carries, so the library fails closed like the CLI.

Rules:
- ``load_with_heads`` resolves the checkpoint's receipt (melix_fsm.receipt, default
  config) and attaches it to the head it returns (``attach``). A refused receipt still
  returns the head: decoding stays possible, speculating does not.
- The decoders ask ``refusal(head)`` before anything else: a head whose receipt refuses
  yields the receipt's own typed reason and message, in the CLI's form
  ``"<reason>: <message>"``, and the decoder decodes plainly. A head without a receipt
  (built by hand, a test's scripted head) is judged by the decoders' own checks only.
- ``load_with_heads(..., num_draft_tokens=, device_policy=)`` records the settings it was
  given on the head too (``attach_settings``): the decoders' defaults for that head
  (melix_mlx.decoding.startup.activate).
"""

from __future__ import annotations

from typing import Any

from melix_fsm.reasons import refusal_text

_ATTR = "melix_receipt"
_SETTINGS = "melix_settings"


def of_receipt(receipt: Any) -> str | None:
    """``"<reason>: <message>"`` when the receipt refuses speculation, else None."""
    reason = getattr(receipt, "refusal_reason", None)
    if reason is None:
        return None
    return refusal_text(reason, receipt.message)


def attach(head: Any, receipt: Any) -> None:
    """Record ``receipt`` on ``head`` (a plain attribute, outside its parameters)."""
    object.__setattr__(head, _ATTR, receipt)


def receipt_of(head: Any) -> Any:
    return getattr(head, _ATTR, None) if head is not None else None


def refusal(head: Any) -> str | None:
    """Why ``head``'s receipt refuses speculation, or None (admitted, or no receipt)."""
    return of_receipt(receipt_of(head))


def attach_settings(head: Any, settings: dict[str, Any]) -> None:
    """Record the library settings ``head`` was loaded with (only those given)."""
    object.__setattr__(head, _SETTINGS, dict(settings))


def settings_of(head: Any) -> dict[str, Any]:
    """The settings ``load_with_heads`` was given for ``head`` ({} when none)."""
    return dict(getattr(head, _SETTINGS, None) or {}) if head is not None else {}
