"""Family detection for the loaders, read from the project's one registry (spec/families.toml).

Rules:
- Nothing about a family is written here: model types, head-count keys and head modules
  come from `melix_fsm.registry`. A family the registry does not run (refused, no MTP,
  unknown) raises `UnsupportedModel` with the registry's reason.
- The family name returned is the head module's name, which is what `melix_mlx.loading.heads`
  is keyed by.
"""

from __future__ import annotations

from typing import Any

from melix_fsm.checkpoint import config_value
from melix_fsm.registry import Family, Support, registry

from .errors import UnsupportedModel

FAMILIES = tuple(
    sorted({f.head_module for f in registry().families.values() if f.head_module})
)


def family_entry(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    family = registry().family_for(str(model_type)) if model_type is not None else None
    if family is None or family.support is not Support.mtp or not family.head_module:
        why = family.message if family is not None and family.message else "no runnable MTP head"
        raise UnsupportedModel(
            f"model_type {model_type!r}: {why} (runnable: {', '.join(FAMILIES)})",
            details={"model_type": model_type},
        )
    return family


def detect_family(config: dict[str, Any]) -> str:
    """The head module name for `config`, or raise `UnsupportedModel`."""
    return family_entry(config).head_module


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the language-model settings (nested for qwen3_5)."""
    return config.get("text_config", config)


def advertised_head_count(config: dict[str, Any]) -> int:
    """How many MTP layers the config says the checkpoint ships (first registry key present)."""
    entry = family_entry(config)
    for key in entry.head_count_keys:
        found, value = config_value(config, key)
        if found and value is not None:
            return int(value or 0)
    return entry.head_count_default
