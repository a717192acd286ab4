"""Fixtures of the conformance-kit tests: tiny checkpoints, scripted heads, the kit's fixture.

Rules:
- mlx is optional here: fixtures that need it import it inside and skip without it, so the
  pure tests of the kit run anywhere.
- `tiny(family)` loads a tiny checkpoint (seed 3) once per session: (model, head).
- `scripted(family, wrong_every)` returns (model, ScriptedHead, reference): the head is
  tests/adapters/scripted_head.py, and it learns every request's reference continuation
  the moment the kit asks the reference for it, so its drafts are right except where
  `wrong_every` makes them wrong on purpose: full accepts, partial accepts and rollbacks.
- The `conformance` fixture comes from the kit's pytest plugin (a non-root conftest may
  not use `pytest_plugins`, so it is imported here).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from melix_fsm.testing import mlx_greedy_reference
from melix_fsm.testing.pytest_plugin import conformance  # noqa: F401  (the kit's fixture)

_SCRIPTED_HEAD = Path(__file__).parent.parent / "adapters" / "scripted_head.py"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Any]]:
    pytest.importorskip("mlx_lm")
    from melix_mlx.loading import load_with_heads
    from melix_mlx.tools.tiny import make_tiny

    root = tmp_path_factory.mktemp("conformance-tiny")
    loaded: dict[str, tuple[Any, Any]] = {}

    def get(family: str) -> tuple[Any, Any]:
        if family not in loaded:
            model, _, head, _ = load_with_heads(make_tiny(family, root / family, seed=3))
            loaded[family] = (model, head)
        return loaded[family]

    return get


def _scripted_head_class() -> type:
    spec = importlib.util.spec_from_file_location("_conformance_scripted_head", _SCRIPTED_HEAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ScriptedHead


@pytest.fixture(scope="session")
def scripted(tiny: Callable[[str], tuple[Any, Any]]) -> Callable[..., tuple[Any, Any, Any]]:
    head_class = _scripted_head_class()

    def get(family: str, wrong_every: int | None = 3) -> tuple[Any, Any, Any]:
        from melix_mlx.tools.tiny_tokenizer import VOCAB_SIZE

        model, _ = tiny(family)
        # the head ignores hidden states; its own hidden output only feeds its next call
        head = head_class([], VOCAB_SIZE, 8, wrong_every=wrong_every)
        greedy = mlx_greedy_reference(model)

        def reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
            out = greedy(prompt, max_tokens)
            # the head's slot convention: context t_1.. predicts the token after it
            seen = list(prompt[1:]) + list(out)
            for m in range(1, len(seen)):
                head.table.setdefault(tuple(seen[:m]), seen[m])
            return out

        return model, head, reference

    return get
