"""The `melix-fsm` command line.

Rules of this module:
- Each subcommand lives in its own module exposing `register(subparsers)`, which adds
  a parser whose `run` default takes the parsed args and returns the exit status.
- Importing a command module must stay cheap and must not import mlx: commands that
  need mlx (they live in melix_mlx.commands) import it inside their run function, so
  `melix-fsm --help` and the core commands work without mlx installed.
- Exit status: 0 success, 2 usage error or unreadable input, 3 a typed refusal; a
  command documents any other status it uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Listed in the order `--help` shows them.
COMMAND_MODULES: tuple[str, ...] = (
    "melix_mlx.commands.generate",
    "melix_mlx.commands.serve",
    "melix_fsm.commands.receipt",
    "melix_mlx.commands.calibrate",
    "melix_mlx.commands.bench",
    "melix_mlx.commands.make_tiny",
    "melix_mlx.commands.convert",
    "melix_fsm.commands.diagram",
)

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_REFUSED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="melix-fsm",
        description="Native MTP speculative decoding for mlx-lm, specified as state machines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that command is not built yet or its package is absent
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
