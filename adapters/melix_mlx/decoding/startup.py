"""One start-up sequence for every command that decodes: settings -> receipt -> load -> evaluate.

`generate` and `serve` (and anything embedding the library the same way) start a model
through `start`: the receipt is resolved before any weight is read, the model is loaded
with its head slot filled only where the receipt admits it, and the device policy is
evaluated on the loaded model, so receipt, loaded head and live controller agree.

Rules of this module:
- Refusals are typed and raised before any work they would waste (`StartRefused`, with
  the receipt as data): a checkpoint nothing can read (a usage error), a serving context
  not even plain decoding can run, an explicitly requested method the receipt or the
  head loader refuses (fail closed). A checkpoint mlx-lm cannot load is `StartFailed`.
- Best effort otherwise, never silent: a refused receipt or a head that fails to load
  with no method given decodes plainly; `Start.refusal` and `Start.load_error` say why
  and the row's lifecycle machine records the late refusal.
- `auto` depth becomes a number in one place (melix_mlx.decoding.activation.draft_budget).
- The library's keywords (`num_draft_tokens`, `device_policy` of `mtp_stream_generate`,
  `MTPBatchGenerator`, `load_with_heads`) resolve through `activate`: the same checks
  (melix_fsm.config; a bad value is a `SettingError` before any work), the same receipt
  (resolved again from the checkpoint the head was loaded from, for the call's settings
  and serving context) and the same device-policy evaluation as `start`. A call that
  names no policy and an int depth keeps the library's earlier behaviour: no controller,
  speculation at that depth on every step (`device_policy=None`; docs/api/stability.md).
- Calibrations are reused from the calibration cache (melix_mlx.decoding.calibration_cache)
  where the caller passes one: `generate` and the library do.
- Callers print; this module does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from melix_fsm.config import (
    AUTO_DEPTH,
    DevicePolicy,
    Method,
    SettingError,
    Source,
    SpeculativeConfig,
    check_settings,
    speculative_config,
)
from melix_fsm.errors import MelixError
from melix_fsm.lifecycle import Event, SequenceMachine, Signal
from melix_fsm.reasons import RefusalReason, refusal_text
from melix_fsm.receipt import Mode, Receipt, ServingContext, receipt_json, resolve, serving_refusal

from ..loading.errors import HeadLoadError, UnsupportedServing
from ..loading.method_load import load_for_method, load_plain
from ..runtime.distributed import ShardingRefused
from .activation import draft_budget, evaluate


class StartFailed(MelixError):
    """The model cannot be started (a checkpoint mlx-lm cannot load): a usage error."""


class StartRefused(MelixError):
    """The start is refused with a typed reason; `receipt` is the receipt as JSON data.

    `usage` marks a refusal that is the caller's input (an unreadable checkpoint)."""

    def __init__(self, reason: str, message: str, receipt: dict[str, Any], *, usage: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.receipt, self.usage = reason, message, receipt, usage


@dataclass
class Start:
    """What a start loaded and decided."""

    path: Path
    config: SpeculativeConfig
    model: Any
    tokenizer: Any
    head: Any  # the MTP head or draft model; None when speculation is refused or off
    receipt: Receipt
    controller: Any  # the live controller (melix_fsm.policy.controller); None without a head
    refusal: str | None  # why the rows decode plainly ("<reason>: <message>"), or None
    load_error: dict[str, str] | None  # the head loader's typed failure, when it refused
    machine: SequenceMachine  # the first row's lifecycle machine (its resolution recorded)
    k: int  # the drafts decoders build rows for (`draft_budget`)
    speculate: bool = False  # the device policy's first decision (the hardware gate admitted)

    @property
    def receipt_data(self) -> dict[str, Any]:
        return self.receipt.to_dict()  # the typed receipt's own plain data: the CLI and the server print it

    @property
    def explicit(self) -> bool:
        return self.config.method is not Method.none and self.config.sources.method is Source.explicit


def start(
    path: Path,
    config: SpeculativeConfig,
    context: ServingContext,
    *,
    batch_size: int = 1,
    eval_context: Any = None,
    sharding: str | None = None,
    receipt: Receipt | None = None,
    machine: SequenceMachine | None = None,
    preloaded: tuple[Any, Any, Any] | None = None,
    evaluate_policy: bool = True,
    calibration_cache: Any = None,
) -> Start:
    """Resolve, load and evaluate the model at `path` (see the module rules).

    `evaluate_policy=False` stops before the device policy (no controller): a caller that
    measures speculation itself (the bench) still gets the receipt, the typed refusals and
    the load exactly as `generate` and `serve` do.

    `receipt` / `preloaded` / `machine`: a start whose receipt was resolved already (a
    sidecar pack's contract loads the target to probe it: (model, tokenizer, head)).
    `eval_context(tokenizer)`: the context the device policy prices (None: its default).
    `calibration_cache`: where a stored calibration of this model and machine is reused
    from (melix_mlx.decoding.calibration_cache; None: measure every start).
    """
    machine = machine if machine is not None else SequenceMachine(0)
    if receipt is None:
        receipt = resolve(path, config, context=context, machine=machine)
    data = json.loads(receipt_json(receipt))
    explicit = config.method is not Method.none and config.sources.method is Source.explicit
    reason = receipt.refusal_reason
    if reason is RefusalReason.unreadable_checkpoint:
        raise StartRefused(reason.value, receipt.message, data, usage=True)
    unservable = serving_refusal(path, context)
    if unservable is not None:  # not even plain decoding can run this serving context
        raise StartRefused(unservable[0].value, unservable[1], data)
    refusal = None if receipt.mode is Mode.accepted else f"{reason.value}: {receipt.message}"
    if receipt.mode is Mode.refused and explicit:
        raise StartRefused(reason.value, receipt.message, data)
    model, tokenizer, head, load_error = _load(path, config, sharding, refusal, preloaded, data, explicit)
    if load_error is not None:
        refusal = f"{load_error['reason']}: {load_error['message']}"
        # the receipt admitted this start: the spec's late refusal, on the same machine
        machine.send(Signal(event=Event.refuse, reason=refusal))
    controller, speculate = None, False
    if head is not None and refusal is None and evaluate_policy:
        priced = eval_context(tokenizer) if eval_context is not None else None
        activation = evaluate(
            model, head, receipt, config, batch_size=batch_size, context=priced, cache=calibration_cache
        )
        receipt, controller = activation.receipt, activation.controller
        speculate = activation.decision.speculate
    head = head if refusal is None else None
    k = draft_budget(config, controller)
    return Start(
        path, config, model, tokenizer, head, receipt, controller, refusal, load_error, machine, k, speculate
    )


def _load(
    path: Path,
    config: SpeculativeConfig,
    sharding: str | None,
    refusal: str | None,
    preloaded: tuple[Any, Any, Any] | None,
    receipt: dict[str, Any],
    explicit: bool,
) -> tuple[Any, Any, Any, dict[str, str] | None]:
    """(model, tokenizer, head, the head loader's refusal): the head slot filled only
    where nothing refused it; the plain model otherwise."""
    head = load_error = None
    model = tokenizer = None
    try:
        if refusal is None and preloaded is not None:
            model, tokenizer, head = preloaded
        elif refusal is None:
            try:
                model, tokenizer, head = load_for_method(path, config, sharding)
            except (HeadLoadError, UnsupportedServing) as exc:
                if explicit:
                    raise StartRefused(str(exc.reason), str(exc), receipt) from exc
                load_error = {"reason": str(exc.reason), "message": str(exc)}
                head = None
        if model is None or tokenizer is None:
            model, tokenizer = load_plain(path, sharding)
    except ShardingRefused as exc:  # the same on every rank: decided from config and group size
        raise StartRefused(str(exc.reason), str(exc), receipt) from exc
    except StartRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint mlx-lm cannot load is a usage error
        raise StartFailed(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc
    return model, tokenizer, head, load_error


DEVICE_POLICIES = tuple(p.value for p in DevicePolicy)


@dataclass
class Activated:
    """What a library call resolved: the depth its rows are built for, the live
    controller (None: speculate at `k` on every step, the caller's choice), the receipt,
    the refusal that makes it decode plainly, and the lifecycle machine resolution drove."""

    k: int
    controller: Any
    receipt: Receipt | None
    refusal: str | None
    machine: SequenceMachine | None = None


def activate(
    model: Any,
    head: Any,
    num_draft_tokens: int | str | None,
    device_policy: str | None,
    *,
    controller: Any = None,
    batch_size: int = 1,
    context: int | None = None,
    serving: ServingContext | None = None,
    machine: SequenceMachine | None = None,
    calibration_cache: Any = "default",
) -> Activated:
    """Resolve the library keywords as `start` resolves the CLI's (see the module rules).

    `num_draft_tokens` / `device_policy` None: what `load_with_heads` was given for this
    head, else 1 and no policy. `context`: tokens the run's caches will hold (priced by
    the policy, as `generate` prices its prompts). `serving`: the receipt's serving
    context. `calibration_cache` "default": the user's calibration cache.
    """
    from ..loading import head_receipt

    check_settings(num_draft_tokens, device_policy, controller)
    loaded = head_receipt.settings_of(head)
    if num_draft_tokens is None:
        num_draft_tokens = loaded.get("num_draft_tokens", 1)
    if device_policy is None and controller is None:
        device_policy = loaded.get("device_policy")
    if device_policy is None and num_draft_tokens == AUTO_DEPTH and controller is None:
        device_policy = DevicePolicy.auto.value  # auto depth is the live controller's choice
    receipt = head_receipt.receipt_of(head)
    if controller is not None or device_policy is None:
        # the caller's own controller (or none): the int it was given, else its depth
        k = controller.depth.max_k if num_draft_tokens == AUTO_DEPTH else int(num_draft_tokens)  # type: ignore[arg-type]
        return Activated(k, controller, receipt, None, machine)
    # the method is the head's, as `generate` without --method: a refusal decodes plainly
    config = speculative_config(num_draft_tokens=num_draft_tokens, device_policy=device_policy)
    if head is None:  # nothing to speculate with: the decoders decode plainly and say so
        return Activated(draft_budget(config, None), None, None, None, machine)
    if receipt is None:
        raise SettingError(
            "device_policy",
            f"{device_policy!r} resolves through the head's receipt: load the head with "
            "melix_mlx.loading.load_with_heads, or pass controller= "
            "(melix_fsm.policy.controller.LiveController)",
        )
    machine = machine if machine is not None else SequenceMachine(0)
    receipt = _call_receipt(receipt, config, serving or ServingContext(), machine)
    if receipt.mode is not Mode.accepted:
        refusal = refusal_text(receipt.refusal_reason, receipt.message)
        return Activated(draft_budget(config, None), None, receipt, refusal, machine)
    cache = _default_cache() if calibration_cache == "default" else calibration_cache
    activation = evaluate(model, head, receipt, config, batch_size=batch_size, context=context, cache=cache)
    k = draft_budget(config, activation.controller)
    return Activated(k, activation.controller, activation.receipt, None, machine)


def _call_receipt(
    loaded: Receipt, config: SpeculativeConfig, serving: ServingContext, machine: SequenceMachine
) -> Receipt:
    """The receipt `generate` would resolve for these settings: resolved again from the
    checkpoint (headers only); a sidecar pack's admitted receipt keeps its contract and
    takes the call's settings."""
    import msgspec

    if loaded.sidecar is not None:
        why = None if loaded.mode is Mode.accepted else refusal_text(loaded.refusal_reason, loaded.message)
        machine.send(Signal(event=Event.admit) if why is None else Signal(event=Event.refuse, reason=why))
        return msgspec.structs.replace(
            loaded,
            num_draft_tokens=config.num_draft_tokens,
            device_policy=config.device_policy,
            source=config.sources,
        )
    return resolve(Path(loaded.model), config, context=serving, machine=machine)


def _default_cache() -> Any:
    from .calibration_cache import default_cache

    return default_cache()
