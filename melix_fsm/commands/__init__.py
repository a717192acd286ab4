"""Core subcommands of the melix-fsm CLI (no mlx imports)."""
