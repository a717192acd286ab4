"""What `melix-fsm qa` tests: a built-in generator or a user's factory, and the model it gets.

Rules of this module:
- TARGET is a built-in name (`mlx-lm`: mlx-lm's own `BatchGenerator`, the control;
  `melix`: this project's `MTPBatchGenerator`) or an import path `package.module:factory`.
- The factory contract: `factory(model, **extra) -> generator`, where `extra` holds only
  the keywords the factory's signature names (or all of them, with `**kwargs`): `head`
  (the checkpoint's MTP head, None when it has none) and `temperature` (0.0 for the
  exactness run; the distribution property's T otherwise). A factory that takes no
  `temperature` cannot be run sampled: the distribution property then reports why it
  did not run, it does not guess a sampler.
- Built-ins use small batches for exactness (prefill 2, completion 3) so queueing,
  staggered joins and filters happen in short schedules, and large ones for sampling
  (prefill 16, completion 64) so thousands of draws take few steps; `melix` also draws
  each request's draft count.
- Loading: `load_model(path)` tries the MTP loader first (model and head); a checkpoint
  without a head loads through mlx-lm alone, and a target that needs a head then gets a
  `TargetError` (a usage error).
- Every failure to resolve or build a target is a `TargetError` with a one-line reason.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from melix_fsm.errors import MelixError

BUILTINS = ("mlx-lm", "melix")


class TargetError(MelixError, ValueError):
    """TARGET cannot be resolved, loaded or built (a usage error of `melix-fsm qa`)."""


@dataclass(frozen=True)
class Target:
    name: str
    factory: Callable[..., Any]
    needs_head: bool = False
    insert_options: Mapping[str, Any] = field(default_factory=dict)

    def accepts(self, keyword: str) -> bool:
        try:
            params = inspect.signature(self.factory).parameters.values()
        except (TypeError, ValueError):
            return False
        return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)

    def build(self, model: Any, head: Any, temperature: float = 0.0) -> Any:
        extra: dict[str, Any] = {}
        if self.accepts("head"):
            extra["head"] = head
        if self.accepts("temperature"):
            extra["temperature"] = temperature
        elif temperature > 0:
            raise TargetError(f"{self.name}: the factory takes no temperature keyword, so it cannot sample")
        return self.factory(model, **extra)


def _sampler(temperature: float) -> Any:
    from melix_mlx.sampling import make_sampler

    return make_sampler(temp=temperature)


def _batch_sizes(temperature: float) -> dict[str, int]:
    if temperature > 0:
        return {"prefill_batch_size": 16, "completion_batch_size": 64}
    return {"prefill_batch_size": 2, "completion_batch_size": 3}


def mlx_lm_generator(model: Any, temperature: float = 0.0) -> Any:
    """mlx-lm's own BatchGenerator: the control every correct generator matches."""
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, sampler=_sampler(temperature), **_batch_sizes(temperature))


def melix_generator(model: Any, head: Any = None, temperature: float = 0.0) -> Any:
    """This project's MTPBatchGenerator with two drafts per cycle (requests draw 1-3)."""
    from melix_mlx.batch_generator import MTPBatchGenerator

    return MTPBatchGenerator(
        model,
        head,
        num_draft_tokens=2,
        sampler=_sampler(temperature),
        **_batch_sizes(temperature),
    )


def resolve_target(text: str) -> Target:
    """A built-in name or `package.module:factory` (see the module rules)."""
    if text == "mlx-lm":
        return Target("mlx-lm", mlx_lm_generator)
    if text == "melix":
        from hypothesis import strategies as st

        return Target(
            "melix", melix_generator, needs_head=True, insert_options={"num_draft_tokens": st.integers(1, 3)}
        )
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(
            f"TARGET {text!r} is neither a built-in ({', '.join(BUILTINS)}) "
            "nor an import path package.module:factory"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"cannot import {module_name!r} for TARGET {text!r}: {exc}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise TargetError(f"{module_name!r} has no attribute {attr!r} (TARGET {text!r})")
    if not callable(factory):
        raise TargetError(f"TARGET {text!r} is a {type(factory).__name__}, not a callable factory")
    return Target(text, factory)


def load_model(path: str | Path, *, needs_head: bool) -> tuple[Any, Any]:
    """(model, head) from a checkpoint directory or embedded alias; head None without one."""
    from melix_mlx.checkpoints import resolve_model
    from melix_mlx.errors import MissingHeadWeights, UnsupportedModel
    from melix_mlx.loading import load_with_heads

    directory = resolve_model(path)
    if not Path(directory).is_dir():
        raise TargetError(f"--model {path!r}: no such checkpoint directory or embedded name")
    try:
        model, _, head, _ = load_with_heads(directory)
        return model, head
    except (MissingHeadWeights, UnsupportedModel) as exc:
        if needs_head:
            raise TargetError(f"--model {path!r}: {exc}") from None
    from mlx_lm.utils import load

    model, _ = load(str(directory))
    return model, None


def vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if size else None
