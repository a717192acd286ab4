"""Family detection from a Hugging Face / mlx-lm ``config.json`` dict.

Rules:
- A family is named by the mlx-lm module that runs its main model (``qwen3_5``,
  ``deepseek_v3``, ``mimo``); nothing else is guessed from names or paths.
- The advertised head count comes from the family's own config key
  (``text_config.mtp_num_hidden_layers`` for qwen3_5, ``num_nextn_predict_layers``
  otherwise). A count of 0 or a missing key means the config advertises no head.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedModel

FAMILIES = ("qwen3_5", "deepseek_v3", "mimo")

# model_type -> family. qwen3_5's text-only config may carry "qwen3_5_text".
_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "deepseek_v3": "deepseek_v3",
    "mimo": "mimo",
}


def detect_family(config: dict[str, Any]) -> str:
    """Return the family name for ``config`` or raise ``UnsupportedModel``."""
    model_type = config.get("model_type")
    family = _MODEL_TYPES.get(str(model_type))
    if family is None:
        raise UnsupportedModel(
            f"model_type {model_type!r} has no MTP head support (supported: {', '.join(FAMILIES)})",
            details={"model_type": model_type},
        )
    return family


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the language-model settings (nested for qwen3_5)."""
    return config.get("text_config", config)


def advertised_head_count(config: dict[str, Any]) -> int:
    """How many MTP layers the config says the checkpoint ships."""
    family = detect_family(config)
    if family == "qwen3_5":
        return int(text_config(config).get("mtp_num_hidden_layers", 0) or 0)
    return int(config.get("num_nextn_predict_layers", 0) or 0)
