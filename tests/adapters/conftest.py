"""Session fixtures for adapter tests: tiny checkpoints built once per session.

Rules:
- Skips the whole folder when mlx / mlx-lm are not installed (the core runs without).
- ``tiny_dirs``: {family: Path} of the default tiny HF-layout checkpoint (seed 0).
- ``tiny_checkpoint(family, seed=0, **make_tiny_kwargs) -> Path``: any variant, built
  once per distinct arguments and cached for the session.
- ``converted_dirs``: {family: Path} of ``melix_mlx.loading.convert`` output (unquantized).
- ``loaded_heads``: {family: (model, tokenizer, head, info)} from the HF dirs.
- Fixture directories are shared: tests must copy before modifying them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_mlx.tools.tiny import FAMILIES, make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(family: str, seed: int = 0, **kwargs: Any) -> Path:
        key = json.dumps([family, seed, kwargs], sort_keys=True, default=str)
        if key not in built:
            built[key] = make_tiny(family, root / f"{family}-{len(built)}", seed=seed, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_dirs(tiny_checkpoint: Callable[..., Path]) -> dict[str, Path]:
    return {family: tiny_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="session")
def converted_dirs(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from melix_mlx.loading.convert import convert

    root = tmp_path_factory.mktemp("converted")
    return {family: convert(path, root / family) for family, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def loaded_heads(tiny_dirs: dict[str, Path]) -> dict[str, tuple]:
    from melix_mlx.loading import load_with_heads

    return {family: load_with_heads(path) for family, path in tiny_dirs.items()}
