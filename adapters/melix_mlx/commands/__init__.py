"""Subcommands of the melix-fsm CLI that drive mlx-lm (mlx imported lazily in run).

The core finds them through the `melix_fsm.commands` entry point (pyproject.toml), which
names this package; a new command is one module here plus one line below. Listed in the
order `melix-fsm --help` shows them.
"""

COMMAND_MODULES: tuple[str, ...] = (
    "melix_mlx.commands.generate",
    "melix_mlx.commands.serve",
    "melix_mlx.commands.calibrate",
    "melix_mlx.commands.bench",
    "melix_mlx.commands.make_tiny",
    "melix_mlx.commands.widen",
    "melix_mlx.commands.convert",
    "melix_mlx.commands.qa",
)
