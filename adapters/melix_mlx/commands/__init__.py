"""Subcommands of the melix-fsm CLI that drive mlx-lm (mlx imported lazily in run).

The core finds them through the `melix_fsm.commands` entry point (pyproject.toml), which
names this package; a new command is one module here plus one line below. Listed in the
order `melix-fsm --help` shows them.

Besides COMMAND_MODULES the core reads (melix_fsm.cli):
- REQUIRES / DEFAULT_REQUIRES: the modules each command imports beyond the core, with
  the extra that installs them, checked before the command runs;
- resolve_model: the embedded checkpoints' names, so core commands (`receipt`) accept
  them too. Importing melix_mlx.loading.checkpoints is cheap (no mlx).
"""

from melix_mlx.loading.checkpoints import resolve_model

COMMAND_MODULES: tuple[str, ...] = (
    "melix_mlx.commands.generate",
    "melix_mlx.commands.serve",
    "melix_mlx.commands.calibrate",
    "melix_mlx.commands.bench",
    "melix_mlx.commands.make_tiny",
    "melix_mlx.commands.widen",
    "melix_mlx.commands.convert",
    "melix_mlx.commands.qa",
    "melix_mlx.commands.verify",
)

# (module, extra of melix-fsm that installs it); tests/registry check them against pyproject.toml
DEFAULT_REQUIRES: tuple[tuple[str, str], ...] = (("mlx", "mlx"), ("mlx_lm", "mlx"))
REQUIRES: dict[str, tuple[tuple[str, str], ...]] = {
    "serve": DEFAULT_REQUIRES + (("fastapi", "serve"), ("uvicorn", "serve"), ("prometheus_client", "serve")),
    "bench": DEFAULT_REQUIRES + (("matplotlib", "bench"),),  # tqdm is optional: plain lines without it
    "qa": DEFAULT_REQUIRES + (("hypothesis", "qa"),),
    "verify": DEFAULT_REQUIRES + (("hypothesis", "qa"),),
}

__all__ = ["COMMAND_MODULES", "DEFAULT_REQUIRES", "REQUIRES", "resolve_model"]
