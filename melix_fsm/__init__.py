"""melix-fsm: speculative-decoding lifecycle core (no mlx imports)."""
