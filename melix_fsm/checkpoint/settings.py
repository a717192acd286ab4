"""Typed look-ups of config.json values by dotted key (nested text_config and the like)."""

from __future__ import annotations

from typing import Any


def config_value(config: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key such as "text_config.mtp_num_hidden_layers"."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def int_setting(
    config: dict[str, Any], keys: tuple[str, ...], lo: int, hi: int
) -> tuple[str | None, int | None, str]:
    """(key found, value, problem) for the first present key; value is None when absent or bad."""
    for key in keys:
        found, value = config_value(config, key)
        if not found or value is None:
            continue
        if type(value) is not int:
            return key, None, f"{key} = {value!r} is not an integer"
        if not lo <= value <= hi:
            return key, None, f"{key} = {value} is outside [{lo}, {hi}]"
        return key, value, ""
    return None, None, ""
