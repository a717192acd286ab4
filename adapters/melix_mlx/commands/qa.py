"""`melix-fsm qa TARGET --model DIR`: the property suite against any generator; every distinct bug.

Rules of this module:
- TARGET: a built-in (`mlx-lm`, the control; `melix`, this project's MTPBatchGenerator)
  or `package.module:factory` (melix_mlx.qa.targets states the factory contract). The
  generator's surface is detected (melix_fsm.testing.surfaces) unless `--surface` says.
- Exactness: tokens against mlx-lm's greedy single-sequence decoding of the same loaded
  model (or `--reference package.module:function`, called with the model, returning a
  `(prompt, max_tokens) -> tokens` decoder); lifecycle events where the generator
  reports them. Distribution: at `--temperature T > 0` (default 1.0), `--draws` draws
  against the model's own probabilities at T. Every distinct bug is reported once, shrunk,
  with a replayable schedule; `--skip SIGNATURE` (repeatable, globs allowed) skips known ones.
- `--replay FILE` re-runs the schedules in FILE (one schedule, a bug, or a `--json`
  report) instead of searching, and reports each.
- Profiles: quick (30 examples per round, 2000 draws), deep (400 examples per round,
  8000 draws); `--max-examples` overrides the examples per round.
- Exit status: 0 every property holds, 1 a bug was found (or a replayed schedule still
  fails), 2 usage error (bad TARGET, model, flag or replay file). mlx is imported inside
  `run` only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_BUG, EXIT_USAGE = 0, 1, 2
PROG = "melix-fsm qa"
PROFILES = {
    "quick": {"examples": 30, "draws": 2000, "rounds": 8},
    "deep": {"examples": 400, "draws": 8000, "rounds": 16},
}
SURFACES = ("auto", "batch", "state-machines", "stream")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "qa",
        help="run exactness, distribution and lifecycle properties against a generator",
        description="Check TARGET (mlx-lm, melix, or package.module:factory) on a checkpoint and report "
        "every distinct bug with a replayable schedule. Exit 0 all pass, 1 a bug found, 2 usage error.",
    )
    parser.add_argument("target", metavar="TARGET", help="mlx-lm, melix, or package.module:factory")
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory or embedded name")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="0 skips the distribution"
    )
    parser.add_argument("--max-examples", type=int, default=None, metavar="N", help="examples per round")
    parser.add_argument("--draws", type=int, default=None, metavar="N", help="draws for the distribution")
    parser.add_argument("--skip", action="append", default=[], metavar="SIGNATURE")
    parser.add_argument("--surface", choices=SURFACES, default="auto")
    parser.add_argument("--reference", default=None, metavar="package.module:function")
    parser.add_argument("--replay", default=None, metavar="FILE")
    parser.add_argument("--json", action="store_true", help="one JSON report on stdout")
    parser.set_defaults(run=run)


def _usage(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from melix_fsm.testing.signature import check_pattern

    profile = PROFILES[args.profile]
    try:
        skip = [check_pattern(p) for p in args.skip]
    except ValueError as exc:
        return _usage(f"--skip: {exc}")
    if args.temperature < 0:
        return _usage("--temperature must be >= 0")
    for name in ("max_examples", "draws"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return _usage(f"--{name.replace('_', '-')} must be >= 1")
    replay_doc = None
    if args.replay is not None:
        try:
            replay_doc = json.loads(Path(args.replay).read_text())
        except (OSError, ValueError) as exc:
            return _usage(f"--replay {args.replay}: {exc}")

    from melix_mlx.qa.targets import TargetError, load_model, resolve_target, vocab_size

    try:
        target = resolve_target(args.target)
        model, head = load_model(args.model, needs_head=target.needs_head)
        reference = _reference(args.reference, model)
    except TargetError as exc:
        return _usage(str(exc))
    from melix_fsm.testing.surfaces import SurfaceError, as_surface

    def make(temperature: float) -> Any:
        return target.build(model, head, temperature)

    try:
        probe = as_surface(make(0.0), args.surface)
        make_stops = getattr(probe, "make_stops", None)
        if make_stops is not None:  # a stop builder the installed mlx-lm cannot serve fails here
            make_stops([(3,)])
    except (SurfaceError, TargetError) as exc:
        return _usage(str(exc))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    top = min(vocab_size(model) or 256, 256) - 1
    probs_of = None
    sampling_note = ""
    if args.temperature > 0:
        if target.accepts("temperature"):
            from melix_mlx.qa.probabilities import target_probabilities

            probs_of = target_probabilities(model, args.temperature)
        else:
            sampling_note = f"{target.name}'s factory takes no temperature keyword"
    if replay_doc is not None:
        return _replay(args, replay_doc, make, reference, probs_of)

    from hypothesis import settings as Settings

    from melix_fsm.testing.machine import PROFILES as KIT_PROFILES
    from melix_fsm.testing.qa import run_session

    rng = random.Random(seed)
    start = [rng.randint(3, top) for _ in range(2)]
    # the model's own greedy continuation: a context it is confident in, as in real decoding
    prompt = start + list(reference(tuple(start), 6))
    settings = {
        "target": target.name,
        "model": str(args.model),
        "surface": args.surface,
        "profile": args.profile,
        "seed": seed,
        "skip": skip,
        "temperature": args.temperature,
        "draws": args.draws or profile["draws"],
        "length": 4,  # the first token, then a whole cycle of up to two drafts and its bonus
        "prompt": prompt,
        "alpha": 1e-3,
    }
    examples = args.max_examples or profile["examples"]
    hunt_options = {
        "settings": Settings(KIT_PROFILES["quick"], max_examples=examples),
        "max_rounds": profile["rounds"],
        "tokens": (3, top),
        "prompt_lengths": (1, 8),
        "max_tokens": (1, 8),
        "insert_options": dict(target.insert_options),
    }
    report = run_session(
        make,
        reference,
        settings=settings,
        hunt_options=hunt_options,
        probs_of=probs_of,
        sampling_note=sampling_note,
        surface=args.surface,
    )
    print(json.dumps(report.as_dict(), default=str) if args.json else report.text())
    return report.exit_code


def _reference(spec: str | None, model: Any) -> Any:
    from melix_mlx.qa.targets import TargetError, resolve_target

    if spec is None:
        from melix_fsm.testing import mlx_greedy_reference

        return mlx_greedy_reference(model, min_tokens=8)
    try:
        return resolve_target(spec).factory(model)
    except TargetError as exc:
        raise TargetError(f"--reference: {exc}") from None


def _replay(args: argparse.Namespace, document: Any, make: Any, reference: Any, probs_of: Any) -> int:
    from melix_fsm.testing.qa import replay_schedule, schedules_in
    from melix_fsm.testing.signature import signature_of

    try:
        schedules = schedules_in(document)
    except ValueError as exc:
        return _usage(f"--replay {args.replay}: {exc}")
    results = []
    for schedule in schedules:
        try:
            err = replay_schedule(schedule, make, reference, probs_of=probs_of, surface=args.surface)
        except (ValueError, KeyError) as exc:
            return _usage(f"--replay {args.replay}: {exc}")
        results.append(
            {
                "schedule": schedule,
                "signature": str(signature_of(err)) if err else None,
                "detail": err.detail if err else None,
            }
        )
    failing = [r for r in results if r["signature"]]
    if args.json:
        print(json.dumps({"replayed": results, "verdict": "fail" if failing else "pass"}))
    else:
        for i, r in enumerate(results, 1):
            print(
                f"schedule {i}: "
                + (f"FAILS {r['signature']}\n  {r['detail']}" if r["signature"] else "passes")
            )
    return EXIT_BUG if failing else EXIT_OK
