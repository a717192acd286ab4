"""What `melix-fsm qa` tests: a built-in generator or a user's factory, and the model it gets.

Rules of this module:
- TARGET is a built-in name (`mlx-lm`: mlx-lm's own `BatchGenerator`, the control;
  `melix`: this project's `MTPBatchGenerator`) or an import path `package.module:factory`.
- The factory contract: `factory(...) -> generator`, called with only the keywords its
  signature names (all of them with `**kwargs`): `model` (the model the kit loaded with
  the installed mlx-lm, the one the reference decodes), `checkpoint` (the checkpoint
  directory as a string, for a factory that loads its own model, e.g. a fork whose MTP
  path needs the head mlx-lm's loader drops), `head` (the checkpoint's MTP head, None
  when it has none or melix's loader is unavailable) and `temperature` (0.0 for the
  exactness run; the distribution property's T otherwise). A first positional parameter
  with another name gets the model (the older `factory(model, ...)` form). A factory
  that takes no `temperature` cannot be run sampled: the distribution property then
  reports why it did not run, it does not guess a sampler.
- Built-ins use small batches for exactness (prefill 2, completion 3) so queueing,
  staggered joins and filters happen in short schedules, and large ones for sampling
  (prefill 16, completion 64) so thousands of draws take few steps; `melix` also draws
  each request's draft count. `mlx-lm` samples with mlx-lm's own `make_sampler`.
- Loading, with no mlx-lm version floor: a target that needs a head (`melix`) loads
  through melix's MTP loader (mlx-lm 0.32); every other target gets the installed
  mlx-lm's own `load` (0.31 or 0.32), so the kit runs in the target's environment.
  melix's loader is imported only when a head is needed.
- Every failure to resolve, load or build a target is a `TargetError` with a one-line
  reason (the command turns it into exit 2).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from melix_fsm.errors import MelixError

BUILTINS = ("mlx-lm", "melix")


class TargetError(MelixError, ValueError):
    """TARGET cannot be resolved, loaded or built (a usage error of `melix-fsm qa`)."""


KEYWORDS = ("model", "checkpoint", "head", "temperature")


@dataclass(frozen=True)
class Target:
    name: str
    factory: Callable[..., Any]
    needs_head: bool = False
    insert_options: Mapping[str, Any] = field(default_factory=dict)
    # fixed values of the same options for the kit's probe schedules (request i gets item i % n)
    probe_options: Mapping[str, Sequence[Any]] = field(default_factory=dict)

    def _parameters(self) -> list[inspect.Parameter]:
        try:
            return list(inspect.signature(self.factory).parameters.values())
        except (TypeError, ValueError):
            return []

    def accepts(self, keyword: str) -> bool:
        return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in self._parameters())

    def build(self, model: Any, head: Any, temperature: float = 0.0, checkpoint: str | None = None) -> Any:
        values = {"model": model, "checkpoint": checkpoint, "head": head, "temperature": temperature}
        params = self._parameters()
        args: list[Any] = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if positional and positional[0].name not in KEYWORDS:
            args.append(model)  # the older form: factory(model, ...)
            values.pop("model")
        if temperature > 0 and not self.accepts("temperature"):
            raise TargetError(f"{self.name}: the factory takes no temperature keyword, so it cannot sample")
        extra = {k: v for k, v in values.items() if self.accepts(k)}
        return self.factory(*args, **extra)


def _sampler(temperature: float) -> Any:
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=temperature)


def _batch_sizes(temperature: float) -> dict[str, int]:
    if temperature > 0:
        return {"prefill_batch_size": 16, "completion_batch_size": 64}
    return {"prefill_batch_size": 2, "completion_batch_size": 3}


def mlx_lm_generator(model: Any, temperature: float = 0.0) -> Any:
    """mlx-lm's own BatchGenerator (0.31 or 0.32): the control every correct generator matches."""
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, sampler=_sampler(temperature), **_batch_sizes(temperature))


def melix_generator(model: Any, head: Any = None, temperature: float = 0.0) -> Any:
    """This project's MTPBatchGenerator with two drafts per cycle (requests draw 1-3)."""
    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.runtime.sampling import make_sampler

    return MTPBatchGenerator(
        model,
        head,
        num_draft_tokens=2,
        sampler=make_sampler(temp=temperature),
        **_batch_sizes(temperature),
    )


def resolve_target(text: str) -> Target:
    """A built-in name or `package.module:factory` (see the module rules)."""
    if text == "mlx-lm":
        return Target("mlx-lm", mlx_lm_generator)
    if text == "melix":
        from hypothesis import strategies as st

        return Target(
            "melix",
            melix_generator,
            needs_head=True,
            insert_options={"num_draft_tokens": st.integers(1, 3)},
            probe_options={"num_draft_tokens": [2, 3, 1]},
        )
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(
            f"TARGET {text!r} is neither a built-in ({', '.join(BUILTINS)}) "
            "nor an import path package.module:factory"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001  (whatever the user's module raises on import: one line)
        raise TargetError(
            f"cannot import {module_name!r} for TARGET {text!r}: {type(exc).__name__}: {one_line(exc)}"
        ) from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise TargetError(f"{module_name!r} has no attribute {attr!r} (TARGET {text!r})")
    if not callable(factory):
        raise TargetError(f"TARGET {text!r} is a {type(factory).__name__}, not a callable factory")
    return Target(text, factory)


def mlx_lm_version() -> str:
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "unknown"


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory named by --model (a path or an embedded alias)."""
    from melix_mlx.loading.checkpoints import resolve_model

    directory = resolve_model(path)
    if not Path(directory).is_dir():
        raise TargetError(f"--model {path!r}: no such checkpoint directory or embedded name")
    return Path(directory)


def load_model(path: str | Path, *, needs_head: bool) -> tuple[Any, Any]:
    """(model, head) from a checkpoint directory or embedded alias; head None without one."""
    directory = checkpoint_dir(path)
    if needs_head:
        try:
            from melix_mlx.loading import load_with_heads
            from melix_mlx.loading.errors import MissingHeadWeights, UnsupportedModel
        except ImportError as exc:
            raise TargetError(
                f"the target needs melix's MTP loader, which needs mlx-lm 0.32 (installed: "
                f"{mlx_lm_version()}): {one_line(exc)}"
            ) from None
        try:
            model, _, head, _ = load_with_heads(directory)
        except (MissingHeadWeights, UnsupportedModel) as exc:
            raise TargetError(f"--model {path!r}: {one_line(exc)}") from None
        return model, head
    try:
        from mlx_lm.utils import load

        model, _ = load(str(directory))
    except Exception as exc:  # noqa: BLE001  (any loader failure is a usage error, in one line)
        raise TargetError(
            f"--model {path!r}: mlx-lm {mlx_lm_version()} cannot load it: {type(exc).__name__}: "
            f"{one_line(exc)}"
        ) from None
    return model, None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if size else None
