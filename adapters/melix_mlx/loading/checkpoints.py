"""Short names for the checkpoints embedded in this package.

Rules:
- ``EMBEDDED`` maps an alias to a directory under ``melix_mlx/assets`` (trained by
  ``scripts/train_checkpoint.py``; each directory's ``training_report.json`` holds the
  exact command): ``stdlib-tiny`` (DeepSeek-V3 layout, the default), ``stdlib-hybrid``
  (Qwen3.5 hybrid layout: GatedDeltaNet + full attention) and ``stdlib-tiny-draft`` (no
  head; the draft model for mlx-lm's own speculative decoding).
- ``resolve_model(arg)``: an existing path wins over an alias of the same name (a user's
  directory called ``stdlib-tiny`` is theirs); otherwise an alias gives its embedded
  directory; anything else is returned unchanged as a path, so callers keep their own
  "not a directory" errors.
- A widened preset name (``widen_presets.PRESETS``, e.g. ``stdlib-hybrid-wide``) gives its
  folder in the cache directory, widened from the embedded source on first use.
- No mlx import here: the CLI resolves names before loading anything.
"""

from __future__ import annotations

from pathlib import Path

from ..tools.widen_presets import PRESETS, ensure

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # melix_mlx/assets

EMBEDDED: dict[str, Path] = {
    "stdlib-tiny": ASSETS / "stdlib-tiny",
    "stdlib-hybrid": ASSETS / "stdlib-hybrid",
    "stdlib-tiny-draft": ASSETS / "stdlib-tiny-draft",
}

DEFAULT = "stdlib-tiny"


def resolve_model(arg: str | Path) -> Path:
    """The checkpoint directory named by ``arg``: a path, or an embedded alias."""
    path = Path(arg)
    if path.exists():
        return path
    if str(arg) in EMBEDDED:
        return EMBEDDED[str(arg)]
    if str(arg) in PRESETS:  # widened on first use from its embedded source
        return ensure(str(arg), EMBEDDED[PRESETS[str(arg)][0]])
    return path


def aliases() -> list[str]:
    """The aliases whose checkpoint is present in this installation."""
    return [name for name, path in EMBEDDED.items() if (path / "config.json").is_file()]
