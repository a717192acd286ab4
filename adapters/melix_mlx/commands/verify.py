"""`melix-fsm verify --model M`: check MTP's exactness on your own model, dtype and machine.

Rules of this module:
- Loads M (a checkpoint directory, a `melix-fsm convert [-q]` output, or an embedded
  name) with its MTP head through melix's loader, optionally cast (`--dtype`; model and
  head), and runs melix_mlx.tools.qa.verify on it: batched and single-sequence identity
  against mlx-lm's own decode of the same model object, batch invariance, the kit's
  lifecycle probes, and the sampled distribution. Divergences follow the rounding
  contract of the model's logits dtype (`--near-tie-ulps`, or `--exact`; shared with
  `qa`).
- Prints the table of parts, the divergence rate with its margins, the promise the run
  supports and what the receipt resolves to (`melix-fsm receipt M`); `--json` prints
  the whole report instead (the file to attach to a bug), `--out FILE` writes it to FILE
  beside the printed table. Progress goes to stderr (`--quiet` silences it).
- Profiles (melix_mlx.tools.qa.verify.PROFILES): smoke (CI), quick (the default: a few
  minutes on a laptop-sized model) and full; `--max-tokens` and `--draws` override theirs.
- Exit status: 0 every part passed (near-ties within the contract included), 1 a bug
  was found, 2 usage error or set-up failure (one line on stderr, never a traceback).
  mlx is imported inside `run` only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from .qa import add_contract_options, make_judge

EXIT_OK, EXIT_BUG, EXIT_USAGE = 0, 1, 2
PROG = "melix-fsm verify"
DTYPES = ("auto", "float32", "float16", "bfloat16")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="verify MTP's greedy identity and distribution against mlx-lm on your model, dtype and machine",
        description="Run MTP against mlx-lm's own decode of MODEL on this machine and print the verdict, "
        "the divergence rate with margins and the promise this supports. Exit 0 pass, 1 bug, 2 usage error.",
    )
    parser.add_argument("--model", required=True, metavar="M", help="checkpoint directory or embedded name")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="cast model and head (default: as stored)"
    )
    parser.add_argument("--profile", choices=("smoke", "quick", "full"), default="quick")
    parser.add_argument(
        "-k", "--num-draft-tokens", type=int, default=3, metavar="K", help="largest draft depth"
    )
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N", help="tokens per request")
    parser.add_argument("--draws", type=int, default=None, metavar="N", help="draws for the distribution")
    add_contract_options(parser)
    parser.add_argument("--json", action="store_true", help="one JSON report on stdout")
    parser.add_argument(
        "--out", default=None, metavar="FILE", help="also write the JSON report to FILE (to attach to a bug)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(run=run, reference=None)


def _usage(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    for name in ("num_draft_tokens", "max_tokens", "draws"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return _usage(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 4:
        return _usage("--max-tokens must be >= 4")
    if args.near_tie_ulps is not None and not args.near_tie_ulps > 0:
        return _usage("--near-tie-ulps must be > 0")
    if args.out is not None and not Path(args.out).parent.is_dir():
        return _usage(f"--out {args.out!r}: no such directory")
    try:
        loaded = _load(args)
    except Exception as exc:  # noqa: BLE001  (a load or set-up failure: one line, exit 2)
        lines = str(exc).strip().splitlines()
        return _usage(f"--model {args.model!r}: {type(exc).__name__}: {lines[0] if lines else ''}")
    return _verify(args, *loaded)


def _load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    import mlx.core as mx

    from melix_mlx.loading import load_with_heads
    from melix_mlx.tools.qa.targets import checkpoint_dir

    directory = checkpoint_dir(args.model)
    model, _, head, _ = load_with_heads(directory)
    if head is None:
        raise ValueError("the checkpoint has no MTP head to verify")
    if args.dtype != "auto":
        dtype = getattr(mx, args.dtype)
        model.set_dtype(dtype)
        head.set_dtype(dtype)
    mx.eval(model.parameters(), head.parameters())
    return model, head, str(directory)


def _receipt(directory: str, k: int) -> dict[str, Any] | None:
    from melix_fsm.config import speculative_config
    from melix_fsm.receipt import resolve
    from melix_fsm.receipt.schema import ServingContext

    r = resolve(directory, speculative_config(num_draft_tokens=k), context=ServingContext(batched=True))
    return {
        "mode": str(r.mode),
        "resolved_method": str(r.resolved_method),
        "num_draft_tokens": r.num_draft_tokens,
        "family": r.family,
        "quantized_weights": r.quantized_weights,
        "refusal_reason": str(r.refusal_reason) if r.refusal_reason is not None else None,
    }


def _weights(directory: str) -> str:
    """ "dense", or the checkpoint's quantization (`melix-fsm convert -q` records it in config.json)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return "dense"
    return f"{q['bits']}-bit, group {q.get('group_size', '?')}"


def _verify(args: argparse.Namespace, model: Any, head: Any, directory: str) -> int:
    from melix_mlx.tools.qa.margins import logits_dtype
    from melix_mlx.tools.qa.progress import Progress
    from melix_mlx.tools.qa.targets import vocab_size
    from melix_mlx.tools.qa.verify import PROFILES, environment, run_verify

    profile = dict(PROFILES[args.profile])
    if args.max_tokens is not None:
        profile["max_tokens"] = args.max_tokens
        profile["invariance_tokens"] = min(profile["invariance_tokens"], args.max_tokens)
    if args.draws is not None:
        profile["draws"] = args.draws
    judge = make_judge(args, model)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    logits = logits_dtype(model)
    settings = {
        "model": str(args.model),
        "checkpoint": directory,
        "dtype": logits if args.dtype == "auto" else args.dtype,
        "logits_dtype": logits,
        "weights": _weights(directory),
        "profile": args.profile,
        "seed": seed,
        "num_draft_tokens": args.num_draft_tokens,
        "vocab_size": vocab_size(model) or 256,
        "budget": profile,
        **environment(),
    }
    progress = Progress(enabled=not args.quiet, prog=PROG)
    try:
        report = run_verify(
            model,
            head,
            settings=settings,
            judge=judge,
            contract=judge.contract if judge is not None else None,
            profile=profile,
            k=args.num_draft_tokens,
            progress=progress,
        )
    finally:
        progress.close()
    try:
        report.receipt = _receipt(directory, args.num_draft_tokens)
    except Exception as exc:  # noqa: BLE001  (the receipt is context: its failure is reported, not fatal)
        report.receipt = {"error": f"{type(exc).__name__}: {exc}"}
    document = json.dumps(report.as_dict(), default=str)
    if args.out is not None:
        Path(args.out).write_text(document + "\n")
    print(document if args.json else report.text())
    return report.exit_code
