"""What the server serves: one checkpoint, its head slot, its receipt and its live policy.

Rules of this module:
- `load_served_model` takes the settings `melix-fsm receipt` takes (method, depth, draft
  model, device policy, profile, quantized KV, chunked prefill) and runs once, before the
  server listens: the receipt is resolved for a batched start before any weight is read,
  then the model (with its MTP head or draft model when the receipt admits one), then the
  device policy's evaluation (melix_mlx.decoding.activation) at batch size 1, which gives the live
  controller every batch generator of this server shares. A calibration of this model on
  this machine is reused across restarts (melix_mlx.decoding.calibration_cache, as
  `generate` does; a sharded server always measures on every rank together).
- Refused at start, typed (`ServeRefused`): settings no batch can run (a quantized KV
  cache: mlx-lm has no batch cache for it), and an explicitly requested method that the
  receipt or the head loader refuses (fail closed, as `generate`).
- Otherwise best effort, never silent: a refused receipt or a head that fails to load
  (method not given) serves the model plainly; `method = none` serves plainly by choice.
  The refusal is in the receipt endpoint and in every response's usage. An unreadable
  checkpoint or a bad setting raises `ServeError`.
- `MTPModelProvider` is mlx-lm's `ModelProvider` holding that one model: requests for
  another model, an adapter or a draft model are refused with a ValueError (mlx-lm's
  server answers it as an error to that request); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_lm.server import ModelProvider

from melix_fsm.errors import MelixError
from melix_fsm.reasons import RefusalReason


class ServeError(MelixError):
    """The server cannot start (unreadable checkpoint, bad settings): a usage error."""


class ServeRefused(ServeError):
    """The server refuses these settings with a typed reason, before it listens.

    Raised for a serving context nothing here can run batched (a quantized KV cache) and
    for an explicitly requested method that is refused; `receipt` is the receipt as JSON data.
    """

    def __init__(self, reason: RefusalReason, message: str, receipt: dict[str, Any]) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.receipt = receipt


@dataclass
class ServedModel:
    path: Path
    model: Any
    tokenizer: Any
    head: Any  # an MTP head or a draft model; None when speculation is off or refused
    controller: Any  # the live policy (melix_fsm.live_policy), None without a head
    num_draft_tokens: int  # the deepest depth a row drafts
    refusal: str | None
    receipt: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    head_load_error: dict[str, str] | None = None
    requested_method: str = "mtp"  # the resolved method setting (speculative_config)
    vision: Any = None  # melix_mlx.serve.images.VisionServing: images in chat content (--vision)

    @property
    def method(self) -> str:
        """The method rows decode with: the requested one when a head slot is filled, else none."""
        return self.requested_method if self.head is not None and self.refusal is None else "none"


def load_served_model(
    model: str | None,
    num_draft_tokens: int | str | None = None,
    device_policy: str | None = None,
    *,
    method: str | None = None,
    draft_model: str | None = None,
    profile: str | None = None,
    kv: dict[str, int] | None = None,
    chunked_prefill: bool = False,
    sharding: str | None = None,
    vision: Any = None,
) -> ServedModel:
    """The served model for these settings (the `melix-fsm receipt` options; see the rules).

    `kv` holds mlx-lm's quantized-KV keyword arguments (melix_fsm.commands.options.kv_arguments).
    `sharding` (under mlx.launch): the model is sharded over the ranks (melix_mlx.runtime.distributed);
    what mlx-lm cannot shard is refused (`unsupported_sharding`) before a weight is read.
    `vision` (melix_mlx.serve.images.VisionOptions): through the mlx-vlm adapter (images in chats).
    Raises ServeRefused (typed) or ServeError (usage) before the server listens.
    """
    from melix_fsm.config import speculative_config
    from melix_fsm.errors import ConfigError
    from melix_fsm.receipt import ServingContext
    from melix_mlx.decoding.calibration_cache import default_cache
    from melix_mlx.decoding.startup import StartFailed, StartRefused
    from melix_mlx.loading.checkpoints import DEFAULT, resolve_model

    try:
        draft_dir = str(resolve_model(draft_model)) if draft_model else None
        config = speculative_config(
            profile=profile,
            method=method,
            num_draft_tokens=num_draft_tokens,
            draft_model=draft_dir,
            device_policy=device_policy,
        )
    except ConfigError as exc:
        raise ServeError(str(exc)) from exc
    path = resolve_model(model or DEFAULT)
    if not (path / "config.json").is_file():
        raise ServeError(f"{path}: not a checkpoint directory (no config.json)")
    # every served row shares batch caches: the receipt is resolved for a batched start,
    # before any tensor is read
    context = ServingContext(
        quantized_kv=bool(kv),
        chunked_prefill=chunked_prefill,
        batched=True,
        kv_group_size=kv.get("kv_group_size") if kv else None,
    )
    if kv:  # no batch cache quantizes, whatever the family: refused before anything loads
        _refuse_quantized_kv(path, config, context)
    try:
        # the one start-up sequence `generate` runs too: receipt, load, device policy
        # a calibration of this model on this machine is reused across restarts (one process only)
        boot, vision = _start(path, config, context, sharding, vision, default_cache())
    except StartRefused as exc:
        if exc.usage:
            raise ServeError(f"{path}: {exc.message}") from exc
        raise ServeRefused(RefusalReason(exc.reason), exc.message, exc.receipt) from exc
    except StartFailed as exc:
        raise ServeError(str(exc)) from exc
    main, tokenizer, head, controller = boot.model, boot.tokenizer, boot.head, boot.controller
    refusal, head_error, receipt_data, k = boot.refusal, boot.load_error, boot.receipt_data, boot.k
    settings = dict(_config_settings(config), profile=profile, kv=dict(kv) if kv else None)
    settings.update(chunked_prefill=chunked_prefill, sharding=sharding)
    return ServedModel(
        path=path,
        model=main,
        tokenizer=tokenizer,
        head=head,
        controller=controller,
        num_draft_tokens=k,
        refusal=refusal,
        receipt=vision.receipt(receipt_data) if vision else receipt_data,  # notes the vision tower
        settings=vision.settings(settings) if vision else settings,  # and the image bounds
        head_load_error=head_error,
        requested_method=config.method.value,
        vision=vision,
    )


def _start(path: Path, config: Any, context: Any, sharding: str | None, vision: Any, cache: Any) -> tuple:
    """`(start, VisionServing or None)`: `start`, or through the mlx-vlm adapter with `vision`
    (melix_mlx.serve.images.VisionOptions)."""
    from melix_mlx.decoding.startup import start

    if vision is None:
        return start(path, config, context, batch_size=1, sharding=sharding, calibration_cache=cache), None
    if sharding is not None:
        raise ServeError("--vision serves one process; it does not shard")
    from .images import start_vision

    return start_vision(path, config, context, vision, batch_size=1, calibration_cache=cache)


def _config_settings(config: Any) -> dict[str, Any]:
    return {
        "method": config.method.value,
        "num_draft_tokens": config.num_draft_tokens,
        "draft_model": config.draft_model,
        "device_policy": config.device_policy.value,
    }


def _refuse_quantized_kv(path: Path, config: Any, context: Any) -> None:
    """Quantized KV under batching is refused with the receipt as data (unless the receipt or
    the serving context refuses the checkpoint first: then `start` says why)."""
    from melix_fsm.lifecycle import SequenceMachine
    from melix_fsm.receipt import receipt_json, resolve, serving_refusal
    from melix_mlx.loading.errors import batched_quantized_kv

    receipt = resolve(path, config, context=context, machine=SequenceMachine(0))
    unreadable = receipt.refusal_reason is RefusalReason.unreadable_checkpoint
    if not unreadable and serving_refusal(path, context) is None:
        blocked = batched_quantized_kv()
        raise ServeRefused(blocked.reason, blocked.message, json.loads(receipt_json(receipt)))


class MTPModelProvider(ModelProvider):
    """mlx-lm's model provider, holding the one `ServedModel` (see the module rules)."""

    def __init__(
        self, cli_args: argparse.Namespace, served: ServedModel, names: tuple[str, ...] = ()
    ) -> None:
        self.served = served
        super().__init__(cli_args)
        for name in names:  # the alias a client may send as "model"
            self._model_map[name] = cli_args.model

    def served_names(self) -> list[str]:
        """The path and the other names a request's "model" may use for the served model."""
        return [self.cli_args.model, *(k for k in self._model_map if k != self.cli_args.model)]

    def _load(self, model_path: Any, adapter_path: Any = None, draft_model_path: Any = None) -> None:
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("this server serves its model without adapters or draft models")
        if str(model_path) != self.cli_args.model:
            raise ValueError(f"model {model_path!r} is not served here (serving {self.cli_args.model})")
        from mlx_lm.models.cache import make_prompt_cache

        self.model_key = (model_path, None, None)
        self.model = self.served.model
        self.tokenizer = self.served.tokenizer
        self.processor = None
        self.draft_model = None
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(self.model))
