"""The mlx side of `melix-fsm qa`: targets (built-in and imported), model loading, the
target's sampled probabilities. The checks themselves live in melix_fsm.testing."""
