"""What the server serves: one checkpoint, its MTP head, its receipt and its live policy.

Rules of this module:
- `load_served_model` runs once, before the server listens: the receipt is resolved
  before any weight is read, then the model (with its head when the receipt admits
  one), then the device policy's evaluation (melix_mlx.activation) at batch size 1,
  which gives the live controller every batch generator of this server shares.
- Best effort, never silent: a refused receipt or a head that fails to load serves the
  model plainly; the refusal is in the receipt endpoint and in every response's usage.
  An unreadable checkpoint raises `ServeError`.
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


class ServeError(MelixError):
    """The server cannot start (unreadable checkpoint, bad settings)."""


@dataclass
class ServedModel:
    path: Path
    model: Any
    tokenizer: Any
    head: Any  # None when speculation is refused
    controller: Any  # the live policy (melix_fsm.live_policy), None without a head
    num_draft_tokens: int  # the deepest depth a row drafts
    refusal: str | None
    receipt: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)
    head_load_error: dict[str, str] | None = None

    @property
    def method(self) -> str:
        return "mtp" if self.head is not None and self.refusal is None else "none"


def load_served_model(
    model: str | None, num_draft_tokens: int | str | None, device_policy: str | None
) -> ServedModel:
    from mlx_lm.utils import load_tokenizer

    from melix_fsm.config import speculative_config
    from melix_fsm.errors import ConfigError
    from melix_fsm.lifecycle import SequenceMachine
    from melix_fsm.reasons import RefusalReason
    from melix_fsm.receipt import Mode, receipt_json, resolve
    from melix_mlx.activation import evaluate
    from melix_mlx.checkpoints import DEFAULT, resolve_model
    from melix_mlx.errors import HeadLoadError
    from melix_mlx.loading import load_main, load_with_heads

    try:
        config = speculative_config(num_draft_tokens=num_draft_tokens, device_policy=device_policy)
    except ConfigError as exc:
        raise ServeError(str(exc)) from exc
    path = resolve_model(model or DEFAULT)
    if not (path / "config.json").is_file():
        raise ServeError(f"{path}: not a checkpoint directory (no config.json)")
    receipt = resolve(path, config, machine=SequenceMachine(0))  # before any tensor is read
    if receipt.refusal_reason is RefusalReason.unreadable_checkpoint:
        raise ServeError(f"{path}: {receipt.message}")
    refusal = None if receipt.mode is Mode.accepted else f"{receipt.refusal_reason.value}: {receipt.message}"
    head = controller = head_error = None
    try:
        if refusal is None:
            try:
                main, tokenizer, head, _ = load_with_heads(path)
            except HeadLoadError as exc:
                head_error = {"reason": exc.reason, "message": str(exc)}
                refusal = f"{exc.reason}: {exc}"
        if head is None:
            main, main_config = load_main(path)
            tokenizer = load_tokenizer(path, eos_token_ids=main_config.get("eos_token_id", None))
    except (OSError, ValueError, KeyError) as exc:
        raise ServeError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc
    k = config.num_draft_tokens
    if head is not None and refusal is None:
        activation = evaluate(main, head, receipt, config, batch_size=1)
        receipt = activation.receipt
        controller = activation.controller
        if k == "auto":  # rows draft up to the deepest k the controller may choose
            k = controller.depth.max_k
    settings = {
        "num_draft_tokens": config.num_draft_tokens,
        "device_policy": config.device_policy.value,
    }
    return ServedModel(
        path=path,
        model=main,
        tokenizer=tokenizer,
        head=head if refusal is None else None,
        controller=controller,
        num_draft_tokens=int(k) if k != "auto" else 1,
        refusal=refusal,
        receipt=json.loads(receipt_json(receipt)),
        settings=settings,
        head_load_error=head_error,
    )


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
