"""Named widened checkpoints: realistic sizes of the embedded ones, generated on first use.

Rules:
- ``PRESETS`` maps a name to (embedded source, sizes). The sizes are chosen so a model is
  far larger than the CPU caches (>= 0.5 GB float32) while a 3-token verify stays
  <= 1.3x a 1-token forward at batch 1 under OpenBLAS with one thread (measured with
  benchmarks/bench_widen_sizes.py), and a bench cell still finishes in minutes.
- ``ensure(name)`` returns the preset's folder under the cache directory
  (``$MELIX_FSM_CACHE``, else ``~/.cache/melix-fsm``), widening it first when absent or
  when its ``widening.json`` records other sizes or seed. Never committed to the repo.
- No mlx import (``checkpoints.resolve_model`` calls this before anything is loaded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from melix_fsm.commands.paths import cache_dir

from .widen import Sizes

SEED = 0
PRESETS: dict[str, tuple[str, Sizes]] = {
    "stdlib-hybrid-wide": ("stdlib-hybrid", Sizes(hidden=1024)),
    "stdlib-tiny-wide": ("stdlib-tiny", Sizes(hidden=1024)),
}


def _current(path: Path, sizes: Sizes) -> bool:
    receipt = path / "widening.json"
    if not (path / "config.json").is_file() or not receipt.is_file():
        return False
    data = json.loads(receipt.read_text())
    wanted = {k: v for k, v in vars(sizes).items() if v is not None}
    return data.get("requested") == wanted and data.get("seed") == SEED


def ensure(name: str, source_dir: Path, dst: Path | None = None, *, force: bool = False) -> Path:
    """The folder of preset `name` (in the cache unless `dst`), widened from `source_dir`
    (the preset's source checkpoint, resolved by the caller) if not current."""
    from .widen_io import widen_checkpoint

    source, sizes = PRESETS[name]
    path = dst if dst is not None else cache_dir() / name
    if force or not _current(path, sizes):
        print(f"melix-fsm: widening {source} to hidden {sizes.hidden} into {path} (once)", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        widen_checkpoint(source_dir, path, sizes, seed=SEED, force=True)
    return path
