"""One speculative config contract: method, draft tokens, draft model, device policy.

Rules of this module:
- `speculative_config(...)` is the only way a `SpeculativeConfig` is built from operator
  input. The CLI calls it with its flags, Python callers with keyword arguments, and both
  may name a profile file (TOML or JSON). Same settings in, same config out: the CLI/API
  parity tests rely on there being one code path.
- Precedence: an explicit setting (flag or keyword) beats the profile, which beats the
  default. Each resolved setting records its `Source`; a flag and a keyword argument are
  both `explicit`, because the front end is not part of the contract (receipts from the
  CLI and the API are byte-identical).
- Every value is checked here; a bad one raises `ConfigError` naming the setting. Nothing
  is silently coerced or dropped: unknown profile keys are errors.
- Only the four settings below exist. There is no assistant/sidecar setting: sidecar-shaped
  checkpoints are refused by the receipt, never configured.
"""

from __future__ import annotations

import enum
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from .errors import ConfigError

MAX_DRAFT_TOKENS = 16
AUTO_DEPTH = "auto"  # num_draft_tokens = "auto": the live controller chooses k from measurement
MAX_PROFILE_BYTES = 1 * 2**20


class Method(enum.StrEnum):
    none = "none"  # plain decode
    mtp = "mtp"  # the checkpoint's native MTP heads
    draft_model = "draft_model"  # a separate, smaller model with the same vocabulary


class DevicePolicy(enum.StrEnum):
    auto = "auto"  # the measured device policy decides
    force_on = "force_on"  # operator override: speculate whatever the device policy says
    force_off = "force_off"  # operator override: never speculate


class Source(enum.StrEnum):
    default = "default"
    profile = "profile"
    explicit = "explicit"  # a CLI flag or a Python keyword argument


class Sources(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where each resolved setting came from."""

    method: Source = Source.default
    num_draft_tokens: Source = Source.default
    draft_model: Source = Source.default
    device_policy: Source = Source.default


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The resolved operator contract for one speculative start."""

    method: Method = Method.mtp
    num_draft_tokens: int | Literal["auto"] = 1
    draft_model: str | None = None
    device_policy: DevicePolicy = DevicePolicy.auto
    sources: Sources = Sources()

    def __post_init__(self) -> None:
        # Built directly (not through speculative_config) the values are still checked,
        # and strings become enum members, so no unchecked config reaches `resolve`.
        for setting in SETTINGS:
            value = getattr(self, setting)
            if value is not None or setting != "draft_model":
                msgspec.structs.force_setattr(self, setting, _check(setting, value))
        if (self.method is Method.draft_model) != (self.draft_model is not None):
            raise ConfigError("draft_model", "is required with, and only with, method = draft_model")


SETTINGS: tuple[str, ...] = ("method", "num_draft_tokens", "draft_model", "device_policy")


def int_or_auto(text: str) -> int | Literal["auto"]:
    """A command-line --num-draft-tokens value (an argparse `type`): an integer or "auto".

    Raises ValueError, which argparse reports as a usage error; the range is checked by
    `speculative_config` like every other value.
    """
    return AUTO_DEPTH if text == AUTO_DEPTH else int(text)


def _enum(setting: str, value: Any, kind: type[enum.StrEnum]) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise ConfigError(setting, f"{value!r} is not one of {choices}") from None


def _check(setting: str, value: Any, label: str | None = None) -> Any:
    """Validate one setting's value; return it normalised. `label` names it in errors."""
    try:
        return _check_value(setting, value)
    except ConfigError as exc:
        if label is None:
            raise
        raise ConfigError(label, exc.problem) from None


def _check_value(setting: str, value: Any) -> Any:
    if setting == "method":
        return _enum(setting, value, Method)
    if setting == "device_policy":
        return _enum(setting, value, DevicePolicy)
    if setting == "num_draft_tokens":
        if value == AUTO_DEPTH:
            return AUTO_DEPTH
        if type(value) is not int:
            raise ConfigError(setting, f"{value!r} is not an integer or 'auto'")
        if not 1 <= value <= MAX_DRAFT_TOKENS:
            raise ConfigError(setting, f"{value} is outside [1, {MAX_DRAFT_TOKENS}]")
        return value
    if setting == "draft_model":
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(setting, f"{value!r} is not a directory path")
        return value
    raise ConfigError(setting, f"unknown setting; known settings: {', '.join(SETTINGS)}")


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read a profile file's settings (TOML or JSON, by suffix), validated.

    The settings sit at the top level, or in a `speculative` table when the profile also
    holds other sections. A relative `draft_model` is taken relative to the profile file.
    """
    path = Path(path)
    where = f"profile {path}"
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(where, "must end in .toml or .json")
    try:
        data = path.read_bytes() if path.stat().st_size <= MAX_PROFILE_BYTES else None
    except OSError as exc:
        raise ConfigError(where, f"cannot be read: {exc.strerror or exc}") from None
    if data is None:
        raise ConfigError(where, f"is over the {MAX_PROFILE_BYTES}-byte limit")
    try:
        text = data.decode("utf-8")
        doc = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except UnicodeDecodeError:
        raise ConfigError(where, "is not UTF-8") from None
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(where, f"is not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(where, "must hold a table/object of settings")
    if "speculative" in doc:
        doc = doc["speculative"]
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: speculative", "must be a table/object")
    settings: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in SETTINGS:
            raise ConfigError(f"{where}: {key}", f"unknown setting; known settings: {', '.join(SETTINGS)}")
        settings[key] = _check(key, value, f"{where}: {key}")
    draft = settings.get("draft_model")
    if draft is not None and not Path(draft).is_absolute():
        settings["draft_model"] = str(path.parent / draft)
    return settings


def speculative_config(
    *,
    profile: str | Path | None = None,
    method: Method | str | None = None,
    num_draft_tokens: int | Literal["auto"] | None = None,
    draft_model: str | Path | None = None,
    device_policy: DevicePolicy | str | None = None,
) -> SpeculativeConfig:
    """Resolve explicit settings over a profile over the defaults; None means "not given"."""
    explicit = {
        "method": method,
        "num_draft_tokens": num_draft_tokens,
        "draft_model": draft_model,
        "device_policy": device_policy,
    }
    from_profile = load_profile(profile) if profile is not None else {}
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for setting in SETTINGS:
        if explicit[setting] is not None:
            values[setting] = _check(setting, explicit[setting])
            sources[setting] = Source.explicit
        elif setting in from_profile:
            values[setting] = from_profile[setting]
            sources[setting] = Source.profile
    resolved_method = values.get("method", Method.mtp)
    if resolved_method is Method.draft_model and "draft_model" not in values:
        raise ConfigError("draft_model", "method = draft_model needs a draft model directory")
    if resolved_method is not Method.draft_model and "draft_model" in values:
        raise ConfigError(
            "draft_model",
            f"is set ({sources['draft_model']}) but method is {resolved_method.value} "
            "(a draft model is only used with method = draft_model)",
        )
    return SpeculativeConfig(**values, sources=Sources(**sources))


class SettingError(ConfigError, ValueError):
    """A library keyword (`num_draft_tokens`, `device_policy`, `controller`) is unusable;
    raised before any work. A `ValueError` too, as the decoders' earlier checks were."""


def check_settings(num_draft_tokens: Any, device_policy: Any, controller: Any = None) -> None:
    """Raise `SettingError` for a value the library keywords do not take (before any work)."""
    try:
        speculative_config(num_draft_tokens=num_draft_tokens, device_policy=device_policy)
    except ConfigError as exc:
        raise SettingError(exc.setting, exc.problem) from None
    if controller is not None and device_policy is not None:
        raise SettingError("device_policy", "pass either device_policy or controller=, not both")
