"""The device policy: when speculation pays on this device, measured rather than guessed.

One concern per module, in the order data flows through them:

- `telemetry`   hardware priors (chip name, loaded BLAS): a recorded guess, never a decision
- `calibration` timed forwards -> `Timings` (median, spread, budget); typed failures
- `cost_model`  `Timings` / `TimingTable`, acceptance priors, E(k) and the predicted speedup
- `decision`    `decide`: the admission gate the receipt records (fail closed, operator overrides)
- `throughput`  forgetting windows of tokens/s and per-position acceptance
- `depth`       `DepthChooser`: the auto depth from measured per-position acceptance
- `live_types`  the controller's actions, reasons, config, shared decision, events, counters
- `controller`  `LiveController`: speculate only while it measures faster than plain decode
- `errors`      `PolicyError`, `CalibrationError(reason)`

All of it is pure and sans-IO (no mlx; only `calibration` reads a clock, through the
callables it is handed). The mlx side lives in melix_mlx.runtime.calibrate (the timed forwards) and
melix_mlx.decoding.activation (measure, decide, build the controller, complete the receipt).
Import from the submodule that owns a name; this package re-exports nothing.
"""
