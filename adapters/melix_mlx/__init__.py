"""mlx-lm glue for melix-fsm: MTP heads, loading, rollback, decode."""
