"""Subcommands of the melix-fsm CLI that drive mlx-lm (mlx imported lazily in run)."""
