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
- A plugin package may also declare what its commands need (`REQUIRES`: command name
  -> (module, extra) pairs, `DEFAULT_REQUIRES` for the others): `main` checks them
  before the command runs and exits 2 naming the extra to install
  (melix_fsm.commands.extras), never a traceback after the work. It may name models
  (`resolve_model(name) -> path`, e.g. the embedded checkpoints): `resolve_model` here
  asks each plugin, so core commands accept the same names as the plugins' commands.
- Exit status: 0 success, 2 usage error or unreadable input, 3 a typed refusal; a
  command documents any other status it uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

from .commands.extras import Requirement, messages, missing

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
    for package in plugin_packages():
        before = set(subparsers.choices)
        for name in package.COMMAND_MODULES:
            importlib.import_module(name).register(subparsers)
        declared = getattr(package, "REQUIRES", {})
        default = tuple(getattr(package, "DEFAULT_REQUIRES", ()))
        for command in set(subparsers.choices) - before:
            subparsers.choices[command].set_defaults(requires=tuple(declared.get(command, default)))
    for name in CORE_COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def plugin_packages() -> list[ModuleType]:
    """The packages named by the `melix_fsm.commands` entry points, in entry-name order."""
    packages: list[ModuleType] = []
    for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            packages.append(entry.load())
        except ModuleNotFoundError as exc:
            if exc.name and entry.value.startswith(exc.name):
                continue  # the plugin's package is installed in metadata only (e.g. removed)
            raise
    return packages


def command_modules() -> list[str]:
    """Every command module: the plugins' (entry points, in name order), then the core's."""
    names: list[str] = []
    for package in plugin_packages():
        names.extend(package.COMMAND_MODULES)
    return names + list(CORE_COMMAND_MODULES)


def resolve_model(arg: str) -> str:
    """The checkpoint directory `arg` names: an existing path as given, else the first
    plugin's model of that name (an embedded checkpoint), else `arg` unchanged (so the
    caller reports it as unreadable)."""
    if Path(arg).exists():
        return arg
    for package in plugin_packages():
        resolver = getattr(package, "resolve_model", None)
        if resolver is not None and (found := Path(resolver(arg))) != Path(arg):
            return str(found)
    return arg


def missing_requirements(prog: str, requires: Sequence[Requirement]) -> list[str]:
    """The lines to print when a command's optional dependencies are absent (empty: all found)."""
    return messages(prog, missing(requires))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    lines = missing_requirements(f"{parser.prog} {args.command}", getattr(args, "requires", ()))
    if lines:  # before any work: a missing extra is a usage error, never a late traceback
        print("\n".join(lines), file=sys.stderr)
        return EXIT_USAGE
    return int(run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
