"""Train ``stdlib-tiny`` (DeepSeek-V3) or ``stdlib-hybrid`` (Qwen3.5): a trained native MTP head.

The project's embedded default model and its draft model, rebuilt from the running
interpreter's own standard library. The recipe lives in ``scripts/training/`` (its package
docstring states the rules it keeps); this file is its command line.

Usage::

    python scripts/train_checkpoint.py --out adapters/melix_mlx/assets/stdlib-tiny
    python scripts/train_checkpoint.py --out adapters/melix_mlx/assets/stdlib-tiny-draft \
        --no-head --layers 2 --hidden 128 --intermediate 384 \
        --tokenizer-like adapters/melix_mlx/assets/stdlib-tiny

    python scripts/train_checkpoint.py --family qwen3_5 \
        --out adapters/melix_mlx/assets/stdlib-hybrid \
        --tokenizer-like adapters/melix_mlx/assets/stdlib-tiny

(The exact command of each embedded checkpoint is its ``training_report.json["command"]``.)

Other options: ``--seed S --steps N --head-steps N --moe-head --dtype ...`` (see ``--help``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script the recipe's folder is already on the path; imported by file (tests) it is not.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from training.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
