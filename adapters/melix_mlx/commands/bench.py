"""`melix-fsm bench`: MTP against mlx-lm's own paths, side by side, in one or both CPU regimes.

Rules of this module:
- `--regime current` measures in this process. `reference` and `openblas` re-run the
  command in a child process with LD_PRELOAD cleared or set to Debian's OpenBLAS (see
  shared design notes: the same CPU is compute-bound with the wheel's reference BLAS and
  bandwidth-bound with OpenBLAS); `both` runs the two children one after the other.
  OpenBLAS runs one thread (`OPENBLAS_NUM_THREADS=1` unless set): mlx's CPU stream
  and the Python host thread need the other cores, and with every core oversubscribed
  a 12-row matmul measured 20x its median now and then (batched verifies hit that size
  and plain steps do not), which made batched ratios both noisy and biased.
- Results go to OUT/bench-<regime>.json and .md, a text table to stdout, the plot to OUT/bench.png;
  OUT is --out, else the cache directory's bench/ (melix_fsm.commands.paths), never the
  working directory. The last line names it.
- Progress on stderr (melix_fsm.commands.progress): a bar on a terminal, plain lines in a log.
- `--peer mlx-vlm` (or NAME=CHECKOUT, repeatable) runs the peers' comparison instead
  (melix_mlx.tools.peer_bench: one worker per contender, interleaved rounds, identity, the
  ideal) in one regime, in this process's re-execution, to OUT/peers-<regime>.json/.md.
- mlx is imported inside `run` only. Exit 0 ok, 2 usage error, 3 the model refused MTP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
EMBEDDED = Path(__file__).resolve().parents[1] / "assets"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark MTP against mlx-lm's plain, batched and draft-model decoding",
        description="Side-by-side tokens/s ratios with acceptance, forwards per token, memory and "
        "the cost model's prediction. Opt-in: it takes minutes.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="directory or embedded name (stdlib-tiny, stdlib-hybrid); default: stdlib-tiny",
    )
    p.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        help="directory or embedded name; default: stdlib-tiny-draft",
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="batch cells: queue B x N requests to generators capped at B rows (continuous batching: "
        "a finished row is replaced from the queue); default 1, a fixed batch",
    )
    p.add_argument(
        "--no-aa-control",
        action="store_true",
        help="skip the A/A control (mlx-lm's run once more per repeat, so each cell reports how far "
        "this machine moves a ratio by itself); saves about a quarter of the run",
    )
    p.add_argument("--regime", choices=["current", "reference", "openblas", "both"], default="current")
    p.add_argument(
        "--out", type=Path, default=None, metavar="DIR",
        help="results directory (default: $MELIX_FSM_CACHE/bench, else ~/.cache/melix-fsm/bench)",
    )  # fmt: skip
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="your own prompts: a JSON list of strings or blank-line-separated blocks "
        "(default: held-out text per workload: code, prose, structured)",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="SPEC",
        help="compare with a peer instead (repeatable): mlx-vlm (the installed mlx-vlm's MTP at each k and "
        "its plain decode) or NAME=CHECKOUT (an mlx_lm fork); single and batch cells, identity, the ideal; "
        "results OUT/peers-<regime>.json and .md (melix_mlx.tools.peer_bench)",
    )
    p.add_argument(
        "--peer-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="with --peer: decode windows on the wall clock or each worker's CPU clock (a shared machine)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--tag", default=None, help=argparse.SUPPRESS)  # set by the parent for its children
    p.set_defaults(run=run)


def regime_env(regime: str) -> dict[str, str]:
    """This process's environment for a child in `regime` ("reference" or "openblas"):
    LD_PRELOAD cleared, or set to OpenBLAS with one thread unless OPENBLAS_NUM_THREADS is set."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if regime == "openblas":
        if not Path(OPENBLAS).exists():
            raise FileNotFoundError(f"{OPENBLAS} (apt-get install libopenblas0-pthread)")
        env["LD_PRELOAD"] = OPENBLAS
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def reexec_in_regime(regime: str) -> None:
    """Re-run this script in `regime` unless it already is (a benchmark script's first call:
    the BLAS must be loaded before mlx, as for the bench command's children)."""
    if (OPENBLAS in os.environ.get("LD_PRELOAD", "")) == (regime == "openblas"):
        return
    try:
        env = regime_env(regime)
    except FileNotFoundError as exc:
        sys.exit(f"--regime openblas: {exc} not found")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _child(args: argparse.Namespace, regime: str) -> dict[str, Any] | int:
    """The regime's results, or the exit status of its failed run."""
    env = regime_env(regime)
    argv = [sys.executable, "-m", "melix_fsm.cli", "bench", "--regime", "current", "--out", str(args.out)]
    argv += ["--model", str(args.model), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    argv += ["--requests-per-slot", str(args.requests_per_slot)]
    argv += ["--batch-sizes", *map(str, args.batch_sizes), "--ks", *map(str, args.ks)]
    argv += ["--temps", *map(str, args.temps), "--tag", regime]
    if args.prompts is not None:
        argv += ["--prompts", str(args.prompts)]
    if args.draft_model is not None:
        argv += ["--draft-model", str(args.draft_model)]
    if args.no_progress:
        argv.append("--no-progress")
    if args.no_aa_control:
        argv.append("--no-aa-control")
    status = subprocess.run(argv, env=env).returncode
    if status != 0:  # the child printed its own error; the other regime still runs
        print(f"melix-fsm bench: the {regime} run failed (exit {status}), its error above", file=sys.stderr)
        return status
    return json.loads((args.out / f"bench-{regime}.json").read_text())


def run(args: argparse.Namespace) -> int:
    counts = (min(args.batch_sizes), min(args.ks), args.repeats, args.requests_per_slot)
    if min(counts) < 1 or args.max_tokens < 2:
        print(
            "melix-fsm bench: error: sizes, k, repeats, requests per slot must be >= 1 and max tokens >= 2",
            file=sys.stderr,
        )
        return 2
    from melix_mlx.loading.checkpoints import resolve_model

    args.model = EMBEDDED / "stdlib-tiny" if args.model is None else resolve_model(args.model)
    if args.draft_model is not None:
        args.draft_model = resolve_model(args.draft_model)
    elif (EMBEDDED / "stdlib-tiny-draft" / "config.json").exists():
        args.draft_model = EMBEDDED / "stdlib-tiny-draft"
    for flag, path in (("--model", args.model), ("--draft-model", args.draft_model)):
        if path is not None and not Path(path).is_dir():  # before minutes of loading and measuring
            print(
                f"melix-fsm bench: error: {flag} {path}: no such directory or embedded name", file=sys.stderr
            )
            return 2
    if args.out is None:
        from melix_fsm.commands.paths import default_output

        args.out = default_output("bench")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.peer:
        return _peers(args)
    from melix_mlx.tools.bench_report import markdown, plot, table

    failed: list[int] = []
    if args.regime in ("reference", "openblas", "both"):
        regimes = ["reference", "openblas"] if args.regime == "both" else [args.regime]
        outcomes = {name: _child(args, name) for name in regimes}
        failed = [status for status in outcomes.values() if isinstance(status, int)]
        results = {name: data for name, data in outcomes.items() if not isinstance(data, int)}
        if not results:
            return failed[0]
    else:
        here = _run_here(args)
        if isinstance(here, int):
            return here
        tag = getattr(args, "tag", None) or "current"
        (args.out / f"bench-{tag}.json").write_text(json.dumps(here, indent=1))
        results = {tag: here}
        if getattr(args, "tag", None):
            return 0  # a child: the parent prints and plots
    for name, data in results.items():
        print(f"== {name}")
        print(table(data))
        (args.out / f"bench-{name}.md").write_text(markdown(data) + "\n")
    print(f"plot: {plot(results, args.out / 'bench.png')}")
    print(f"results: {args.out}")
    return failed[0] if failed else 0


def _peers(args: argparse.Namespace) -> int:
    """`--peer`: the peers' comparison (melix_mlx.tools.peer_bench) in one regime, here."""
    from melix_mlx.tools.peer_bench import markdown, run, write

    if args.regime == "both":
        print("melix-fsm bench: error: --peer runs in one regime, not both", file=sys.stderr)
        return 2
    if args.regime != "current":
        reexec_in_regime(args.regime)  # the BLAS is chosen before mlx loads, in every worker too
    options = argparse.Namespace(
        peer=args.peer, peer_python=None, model=args.model, batch_sizes=args.batch_sizes, ks=args.ks,
        rounds=args.repeats, max_tokens=args.max_tokens, prompt_chars=400, cells=["single", "batch"],
        clock=args.peer_clock, ideal=True, profile=False, command=["melix-fsm", *sys.argv[1:]],
    )  # fmt: skip
    result = run(options)
    tag = "openblas" if OPENBLAS in os.environ.get("LD_PRELOAD", "") else "reference"
    write(result, args.out / f"peers-{tag}.json")
    (args.out / f"peers-{tag}.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    print(f"results: {args.out}")
    return 0


def _run_here(args: argparse.Namespace) -> dict[str, Any] | int:
    """The bench in this process (the current BLAS): its results, or an exit status."""
    from melix_mlx.decoding.startup import StartFailed, StartRefused
    from melix_mlx.loading.errors import HeadLoadError
    from melix_mlx.tools.bench import run as bench_run
    from melix_mlx.tools.workloads import from_file

    try:
        prompts = from_file(args.prompts) if args.prompts is not None else None
    except (OSError, ValueError) as exc:
        print(f"melix-fsm bench: error: --prompts: {exc}", file=sys.stderr)
        return 2
    try:
        return bench_run(
            args.model,
            draft_dir=args.draft_model,
            batch_sizes=args.batch_sizes,
            ks=args.ks,
            temps=args.temps,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            show_progress=not args.no_progress,
            prompts=prompts,
            requests_per_slot=args.requests_per_slot,
            aa_control=not args.no_aa_control,
        )
    except HeadLoadError as exc:
        print(f"melix-fsm bench: refused: {exc.reason}: {exc}", file=sys.stderr)
        return 3
    except StartRefused as exc:  # the receipt or the head loader refused MTP here
        print(f"melix-fsm bench: refused: {exc}", file=sys.stderr)
        return 2 if exc.usage else 3
    except StartFailed as exc:
        print(f"melix-fsm bench: error: {exc}", file=sys.stderr)
        return 2
