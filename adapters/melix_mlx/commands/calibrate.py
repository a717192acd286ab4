"""`melix-fsm calibrate [--model DIR]`: time the model on this device and print the decision.

Rules of this module:
- `register` is cheap; mlx, mlx-lm and the model load only inside `run`.
- It measures a 1-token decode step, a (k+1)-token verify and one head draft at each
  requested batch size (median of --runs after --warmup), applies the cost model with the
  family's prior acceptance (pricing every forward a cycle runs: the replay forward of
  recurrent layers too, where the decoder replays), and prints the figures and the hardware decision: a table,
  or with --json one object {model, family, dtype, hardware, prior, policy, timings,
  decisions, decision, clashes} where `decision` is the one for the first batch size.
- Batch sizes are measured one by one and not re-measured (this is the raw report), then
  checked against each other (`melix_fsm.policy.calibration.out_of_order`, tolerance
  --max-spread): each clash is printed; the library would measure those sizes again.
- Exit status (melix_fsm.cli): 0 measured (whatever the verdict: a disabled gate is a
  valid answer), 3 a typed refusal (the head cannot be loaded, or the measurement failed,
  timed out or was poisoned, batch sizes clashing included; the decision printed says
  which), 2 usage error.
- Progress on stderr (melix_fsm.commands.progress): loading, then one step per batch
  size; a bar on a terminal, plain lines in a log, nothing with --no-progress.
- Do not run it beside a serving process: competing forwards poison the samples.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from melix_fsm.cli import EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from melix_fsm.policy.calibration import DEFAULT_BUDGET_S, DEFAULT_MAX_SPREAD, DEFAULT_RUNS, DEFAULT_WARMUP
from melix_fsm.policy.decision import DEFAULT_MARGIN, Policy


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure whether MTP speculation pays on this device for a model",
        description="Time a decode step, a verify and a head draft for the model at the given batch "
        "size(s) and print the measured figures with the hardware decision. Exit 0 measured, "
        "3 refused with a typed reason, 2 usage error.",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="checkpoint directory or embedded name (stdlib-tiny, stdlib-hybrid; default: stdlib-tiny)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        metavar="B",
        help="batch size(s) to time (default 1)",
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=1, metavar="K", help="draft depth k (default 1)"
    )
    parser.add_argument("--device-policy", choices=[p.value for p in Policy], default=Policy.auto.value)
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="admit above 1 + margin")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed runs per forward")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="discarded runs per forward")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS")
    parser.add_argument(
        "--max-spread", type=float, default=DEFAULT_MAX_SPREAD, help="refuse samples noisier than this"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    parser.set_defaults(run=run)


def _usage(message: str) -> int:
    print(f"melix-fsm calibrate: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from melix_mlx.loading.checkpoints import DEFAULT, resolve_model

    args.model = resolve_model(DEFAULT if args.model is None else args.model)
    if not Path(args.model).is_dir():
        return _usage(f"--model {args.model!r} is not a directory")
    if args.num_draft_tokens < 1 or min(args.batch_size) < 1 or args.runs < 1 or args.warmup < 0:
        return _usage("--num-draft-tokens, --batch-size and --runs must be >= 1, --warmup >= 0")


    from melix_fsm.commands.progress import Progress
    from melix_fsm.policy.calibration import out_of_order
    from melix_fsm.policy.cost_model import CycleForwards, TimingTable, acceptance_prior, replay_rate
    from melix_fsm.policy.decision import decide
    from melix_fsm.policy.errors import CalibrationError
    from melix_fsm.policy.telemetry import detect

    from ..decoding.activation import replays_on_reject
    from ..loading.errors import HeadLoadError
    from ..loading.loaders import load_with_heads
    from ..runtime.calibrate import device_kind, model_dtype

    progress = Progress(len(args.batch_size), "calibrate", unit="size", enabled=not args.no_progress)
    progress.note("loading the model")
    try:
        model, _tokenizer, head, info = load_with_heads(args.model)
    except HeadLoadError as exc:
        progress.close()
        print(f"melix-fsm calibrate: {exc.reason}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    dtype = model_dtype(model)
    hardware = detect(device=device_kind(), dtype=dtype)
    prior = acceptance_prior(info.family)
    k = args.num_draft_tokens

    results = _measure_sizes(args, model, head, k, progress)
    progress.close()
    # every forward a cycle runs is priced: a restore-and-replay decoder re-runs the kept
    # tokens of recurrent layers on every cycle that rejects a draft (batch-wide)
    replays = replays_on_reject(model)
    decisions = [
        decide(
            r,
            args.device_policy,
            prior,
            args.margin,
            hardware=hardware,
            forwards=CycleForwards(replay=replay_rate(prior.acceptance, k, B) if replays else 0.0),
        )
        for B, r in zip(args.batch_size, results)
    ]
    measured = [r for r in results if not isinstance(r, CalibrationError)]
    table = TimingTable.of(*measured) if measured else None
    clashes = [str(c) for c in out_of_order(measured, args.max_spread)]

    if args.json:
        facts = {"family": info.family, "dtype": dtype, "hardware": hardware, "prior": prior}
        _print_json(args, facts, table, decisions, clashes)
    else:
        _print_table(args, info.family, dtype, hardware, prior, k, results, decisions)
    sys.stdout.flush()
    failed = [r for r in results if isinstance(r, CalibrationError)]
    for exc in failed:
        print(f"melix-fsm calibrate: {exc.reason}: {exc.detail}", file=sys.stderr)
    for clash in clashes:
        print(f"melix-fsm calibrate: measurement_poisoned: {clash}", file=sys.stderr)
    return EXIT_REFUSED if failed or clashes else EXIT_OK


def _measure_sizes(args: argparse.Namespace, model: Any, head: Any, k: int, progress: Any) -> list[Any]:
    """One timing per batch size, or its typed failure: each size is measured on its own, so
    one poisoned size does not hide the others."""
    from melix_fsm.policy.calibration import measure
    from melix_fsm.policy.errors import CalibrationError

    from ..runtime.calibrate import build_forwards

    results: list[Any] = []
    for B in args.batch_size:
        progress.note(f"timing B={B}")
        try:
            fns = build_forwards(model, head, batch_size=B, k=k)
            results.append(
                measure(
                    *fns,
                    k=k,
                    batch_size=B,
                    runs=args.runs,
                    warmup=args.warmup,
                    budget_s=args.budget,
                    max_spread=args.max_spread,
                    note="mtp_head",
                )
            )
        except CalibrationError as exc:
            results.append(exc)
        except Exception as exc:  # building the forwards failed: a typed refusal, not a crash
            results.append(CalibrationError("measurement_failed", f"B={B}: {type(exc).__name__}: {exc}"))
        progress.update(1)
    return results


def _print_json(
    args: argparse.Namespace, facts: dict[str, Any], table: Any, decisions: list[Any], clashes: list[str]
) -> None:
    import msgspec

    out = {
        "model": str(args.model),
        **facts,
        "policy": args.device_policy,
        "timings": list(table.entries) if table else [],
        "decisions": decisions,
        "decision": decisions[0],
        "clashes": clashes,
    }
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(out)) + b"\n")


def _print_table(args, family, dtype, hardware, prior, k, results, decisions) -> None:
    from melix_fsm.policy.cost_model import Timings, expected_tokens

    ratio = f"{hardware.cost_ratio_2:g}" if hardware.cost_ratio_2 is not None else "?"
    blas = f", blas {hardware.blas}" if hardware.blas else ""
    chip = f", chip {hardware.chip}" if hardware.chip else ""
    print(f"model     {args.model} (family {family}, dtype {dtype})")
    print(
        f"hardware  {hardware.platform}{chip}{blas}: prior {hardware.expected_regime.value} "
        f"(assumed 2-token cost {ratio}x)"
    )
    e = expected_tokens(prior.acceptance, k)
    print(f"prior     {prior.name} acceptance {prior.acceptance:g} -> {e:.2f} tokens/cycle at k={k}")
    print(f"policy    {args.device_policy}, admit above {1 + args.margin:.2f}x")
    header = (
        "B",
        "t_1 ms",
        "t_verify ms",
        "t_head ms",
        "verify/t_1",
        "cycle cost",
        "regime",
        "speedup",
        "gate",
    )
    rows = [header]
    for B, r, d in zip(args.batch_size, results, decisions):
        if isinstance(r, Timings):
            rows.append(
                (
                    str(r.batch_size),
                    f"{r.t_1 * 1e3:.3f}",
                    f"{r.t_verify * 1e3:.3f}",
                    f"{r.t_head * 1e3:.3f}",
                    f"{r.t_verify / r.t_1:.2f}",
                    f"{d.cycle_cost:.2f}" + (f" (+{d.replay_rate:.2f} replay)" if d.replay_rate else ""),
                    r.regime.value,
                    f"{d.predicted_speedup:.2f}x",
                    f"{d.hardware_gate.value} ({d.reason.value})",
                )
            )
        else:
            rows.append(
                (str(B), "-", "-", "-", "-", "-", "-", "-", f"{d.hardware_gate.value} ({d.reason.value})")
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
