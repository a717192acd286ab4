"""The `melix-fsm` command line.

Rules of this module:
- Each subcommand lives in its own module exposing `register(subparsers)`, which adds
  a parser whose `run` default takes the parsed args and returns the exit status.
- The core names only its own commands. Other packages add theirs through the
  `melix_fsm.commands` entry-point group: each entry names a package whose
  `COMMAND_MODULES` lists its command modules (the mlx adapter's is melix_mlx.commands),
  so the dependency points from the adapters to the core, never back.
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
from importlib.metadata import entry_points

CORE_COMMAND_MODULES: tuple[str, ...] = ("melix_fsm.commands.receipt", "melix_fsm.commands.diagram")
ENTRY_POINT_GROUP = "melix_fsm.commands"

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_REFUSED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="melix-fsm",
        description="Native MTP speculative decoding for mlx-lm, specified as state machines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in command_modules():
        importlib.import_module(name).register(subparsers)
    return parser


def command_modules() -> list[str]:
    """Every command module: the plugins' (entry points, in name order), then the core's."""
    names: list[str] = []
    for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            package = entry.load()
        except ModuleNotFoundError as exc:
            if exc.name and entry.value.startswith(exc.name):
                continue  # the plugin's package is installed in metadata only (e.g. removed)
            raise
        names.extend(package.COMMAND_MODULES)
    return names + list(CORE_COMMAND_MODULES)


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
