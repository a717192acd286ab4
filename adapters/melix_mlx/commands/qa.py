"""`melix-fsm qa TARGET --model DIR`: the property suite against any generator; every distinct bug.

Rules of this module:
- TARGET: a built-in (`mlx-lm`, the control; `melix`, this project's MTPBatchGenerator)
  or `package.module:factory` (melix_mlx.tools.qa.targets states the factory contract). The
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
- `--stops package.module:builder` builds the target's stop object from a list of token
  tuples (the API's `make_stops`); without it the kit uses mlx-lm's for the detected
  surface, and a call whose requests have no stops passes no stop object at all.
- Exit status: 0 every property holds, 1 a bug was found (or a replayed schedule still
  fails), 2 usage error or set-up failure (bad TARGET, model, flag or replay file; an
  import the installed mlx-lm cannot serve; a factory that raises): one line on stderr,
  never a traceback, never 1. mlx is imported inside `run` only; nothing here needs a
  particular mlx-lm version (the `melix` target alone needs 0.32).
- Divergences follow the contract (melix_fsm.testing.divergence): with the default
  reference, a wrong token is judged by the reference's logits at its first divergent
  position in the dtype the model computes in (`--near-tie-ulps U`, default 8):
  near-ties are counted and reported (rate per 1,000 tokens, histogram), anything else
  is a bug. `--exact` makes every differing token a bug (for a regime known to be
  bit-exact); a `--reference` decoder has no logits, so it is compared exactly.
- `--dtype` casts the loaded model (and head) before anything runs: a factory that
  takes `model` gets the cast one; one that loads its own from `checkpoint` does not.
- `--simulate-rounding DTYPE` puts the target under a simulated rounding regime
  (melix_mlx.tools.qa.simulated: its forwards' logits carry up to 3 ulps of DTYPE of
  noise, so only near-ties can flip) and judges by DTYPE's contract: a check of the
  contract itself on a machine whose kernels do not round differently (with `--exact`
  every flip is a bug, a false alarm by design).
- Progress goes to stderr (melix_mlx.tools.qa.progress); `--quiet` silences it.
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
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="auto",
        help="cast the loaded model (and head) before the run (default: as stored)",
    )
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
    parser.add_argument(
        "--stops",
        default=None,
        metavar="package.module:builder",
        help="builds the target's stop object from a list of token tuples",
    )
    add_contract_options(parser)
    parser.add_argument(
        "--simulate-rounding",
        choices=("float16", "bfloat16"),
        default=None,
        metavar="DTYPE",
        help="perturb the target's logits by up to 3 ulps of DTYPE (only near-ties can flip) and "
        "judge by DTYPE's contract",
    )
    parser.add_argument("--json", action="store_true", help="one JSON report on stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(run=run)


def add_contract_options(parser: argparse.ArgumentParser) -> None:
    """--exact / --near-tie-ulps (shared with `melix-fsm verify`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--exact", action="store_true", help="every differing token is a bug (no rounding contract)"
    )
    group.add_argument(
        "--near-tie-ulps",
        type=float,
        default=None,
        metavar="U",
        help="the contract's near-tie bound, in ulps of the largest logit (default 8)",
    )


def make_judge(args: argparse.Namespace, model: Any) -> Any:
    """The divergence judge the flags ask for; None compares exactly."""
    if args.exact or getattr(args, "reference", None) is not None:
        return None
    from melix_mlx.tools.qa.margins import contract_judge, logits_of

    simulated = getattr(args, "simulate_rounding", None)
    if simulated is not None:  # the regime's dtype, whatever the model computes in
        from melix_fsm.testing.divergence import DEFAULT_ULPS, judge_for

        return judge_for(logits_of(model), simulated, args.near_tie_ulps or DEFAULT_ULPS)
    return contract_judge(model, args.near_tie_ulps)


def _usage(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    """The command; every set-up failure is one line and exit 2 (see the module rules)."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001  (an import or set-up failure: one line, exit 2, never 1)
        where = _origin(exc)
        return _usage(f"{type(exc).__name__}: {_one_line(exc)}{where}")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "(no message)"


def _origin(exc: BaseException) -> str:
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].name})" if frames else ""


def _run(args: argparse.Namespace) -> int:
    from melix_fsm.testing.signature import check_pattern

    profile = PROFILES[args.profile]
    try:
        skip = [check_pattern(p) for p in args.skip]
    except ValueError as exc:
        return _usage(f"--skip: {exc}")
    if args.temperature < 0:
        return _usage("--temperature must be >= 0")
    if args.near_tie_ulps is not None and not args.near_tie_ulps > 0:
        return _usage("--near-tie-ulps must be > 0")
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

    from melix_fsm.testing.surfaces import SurfaceError, as_surface
    from melix_mlx.tools.qa.targets import TargetError, checkpoint_dir, load_model, resolve_target

    try:
        make_stops = resolve_target(args.stops).factory if args.stops else None
    except TargetError as exc:
        return _usage(f"--stops: {exc}".replace("TARGET", "--stops"))
    try:
        target = resolve_target(args.target)
        if args.simulate_rounding is not None:
            from melix_mlx.tools.qa.simulated import simulated_target

            target = simulated_target(target, args.simulate_rounding)
        checkpoint = str(checkpoint_dir(args.model))
        model, head = load_model(args.model, needs_head=target.needs_head)
        if args.dtype != "auto":  # the reference decodes the same cast model object
            import mlx.core as mx

            for module in (model, head):
                if module is not None:
                    module.set_dtype(getattr(mx, args.dtype))
        reference = _reference(args.reference, model)
    except TargetError as exc:
        return _usage(str(exc))

    def make(temperature: float) -> Any:
        return target.build(model, head, temperature, checkpoint=checkpoint)

    try:
        probe = as_surface(make(0.0), args.surface, make_stops)
        builder = getattr(probe, "make_stops", None)
        if builder is not None:  # a stop builder the installed mlx-lm cannot serve fails here, once
            builder([(3,)])
            builder([])
    except (SurfaceError, TargetError, ImportError) as exc:
        return _usage(_one_line(exc))
    sampling_note = ""
    if not target.accepts("temperature"):
        sampling_note = f"{target.name}'s factory takes no temperature keyword"
    probs_for = _probabilities(model)
    if replay_doc is not None:
        return _replay(args, replay_doc, make, reference, probs_for, make_stops, sampling_note, model)

    return _hunt(args, profile, skip, target, model, make, reference, make_stops, probs_for, sampling_note)


def _hunt(
    args: argparse.Namespace,
    profile: dict[str, Any],
    skip: list[Any],
    target: Any,
    model: Any,
    make: Any,
    reference: Any,
    make_stops: Any,
    probs_for: Any,
    sampling_note: str,
) -> int:
    """The hunt and the distribution check on a loaded target, reported."""
    from hypothesis import settings as Settings

    from melix_fsm.testing.machine import PROFILES as KIT_PROFILES
    from melix_fsm.testing.qa import run_session
    from melix_mlx.tools.qa.targets import vocab_size

    from ..tools.qa.progress import Progress

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    top = min(vocab_size(model) or 256, 256) - 1
    rng = random.Random(seed)
    start = [rng.randint(3, top) for _ in range(2)]
    # the model's own greedy continuation: a context it is confident in, as in real decoding
    prompt = start + list(reference(tuple(start), 6))
    settings = {
        "target": target.name,
        "model": str(args.model),
        "dtype": args.dtype,
        "simulated_rounding": args.simulate_rounding,
        "surface": args.surface,
        "profile": args.profile,
        "seed": seed,
        "skip": skip,
        "temperature": args.temperature,
        "draws": args.draws or profile["draws"],
        "length": 4,  # the first token, then a whole cycle of up to two drafts and its bonus
        "prompt": prompt,
        "alpha": 1e-3,
        "examples_per_round": args.max_examples or profile["examples"],
        "max_rounds": profile["rounds"],
    }
    hunt_options = {
        "settings": Settings(KIT_PROFILES["quick"], max_examples=settings["examples_per_round"]),
        "max_rounds": profile["rounds"],
        "tokens": (3, top),
        "prompt_lengths": (1, 8),
        "max_tokens": (1, 8),
        "insert_options": dict(target.insert_options),
        "probe_options": dict(target.probe_options),
        "make_stops": make_stops,
        "judge": make_judge(args, model),
    }
    progress = Progress(enabled=not args.quiet)
    try:
        report = run_session(
            make,
            reference,
            settings=settings,
            hunt_options=hunt_options,
            probs_of=probs_for(args.temperature) if args.temperature > 0 and not sampling_note else None,
            sampling_note=sampling_note,
            surface=args.surface,
            progress=progress,
        )
    finally:
        progress.close()
    print(json.dumps(report.as_dict(), default=str) if args.json else report.text())
    return report.exit_code


def _probabilities(model: Any) -> Any:
    """The target's probabilities at a temperature, built once per temperature."""
    built: dict[float, Any] = {}

    def probs_for(temperature: float) -> Any:
        if temperature not in built:
            from melix_mlx.tools.qa.probabilities import target_probabilities

            built[temperature] = target_probabilities(model, temperature)
        return built[temperature]

    return probs_for


def _reference(spec: str | None, model: Any) -> Any:
    from melix_mlx.tools.qa.targets import TargetError, resolve_target

    if spec is None:
        from melix_fsm.testing import mlx_greedy_reference

        return mlx_greedy_reference(model, min_tokens=8)
    try:
        return resolve_target(spec).factory(model)
    except TargetError as exc:
        raise TargetError(f"--reference: {exc}") from None


def _replay(
    args: argparse.Namespace,
    document: Any,
    make: Any,
    reference: Any,
    probs_for: Any,
    make_stops: Any,
    sampling_note: str,
    model: Any = None,
) -> int:
    """Re-run each schedule at its own temperature (a sample operation carries it)."""
    from melix_fsm.testing.qa import replay_schedule, schedules_in
    from melix_fsm.testing.signature import signature_of

    judge = make_judge(args, model)

    try:
        schedules = schedules_in(document)
    except ValueError as exc:
        return _usage(f"--replay {args.replay}: {exc}")
    results = []
    for schedule in schedules:
        if sampling_note and any(op.get("op") in ("sample", "sampling") for op in schedule):
            return _usage(f"--replay {args.replay}: a sampled schedule, but {sampling_note}")
        try:
            err = replay_schedule(
                schedule,
                make,
                reference,
                probs_for=probs_for,
                surface=args.surface,
                make_stops=make_stops,
                judge=judge,
            )
        except (ValueError, KeyError, TypeError) as exc:
            return _usage(f"--replay {args.replay}: {type(exc).__name__}: {_one_line(exc)}")
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
