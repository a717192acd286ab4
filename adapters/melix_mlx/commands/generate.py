"""`melix-fsm generate`: decode prompts with the checkpoint's MTP head, a draft model, or plainly.

Rules of this module:
- The receipt (melix_fsm.receipt.resolve) is resolved BEFORE any weight is loaded, and
  its lifecycle machine is the sequence's machine for a single prompt. With --json it is
  in every JSON result; with --receipt it is also one JSON line on stderr (`melix-fsm
  generate: receipt: {...}`), completed with the measured hardware gate. Without --json
  the run ends with a one-line summary on stderr (method, k, tokens/s, acceptance, the
  speedup over plain where the policy estimates one; melix_mlx.commands.generate_summary).
- Options: every `melix-fsm receipt` option is accepted here with the same meaning
  (melix_fsm.commands.options), plus mlx-lm's decode options (`--kv-bits`,
  `--kv-group-size`, `--quantized-kv-start`, `--max-kv-size`, `--prefill-step-size`).
- Refusal, fail closed: when `--method mtp|draft_model` was given explicitly and
  speculation is refused (by the receipt, or by a typed error while building the head
  or draft), the command decodes nothing and exits 3 with the receipt (and the error)
  as JSON on stdout and a one-line reason on stderr. When the method was not given, a
  refusal decodes plainly; the receipt and the reason go into every JSON result and a
  note to stderr, so the fallback is recorded, never silent. `--method none` decodes
  plainly.
- Plain fallback everywhere: any checkpoint mlx-lm can load decodes plainly (families
  without an MTP head load through mlx-lm's own loader); a checkpoint it cannot load, or
  an option mlx/mlx-lm reject while decoding (e.g. a KV group size that does not divide
  the head dim), is a one-line error with exit 2, never a traceback. A serving context
  that nothing can run (a quantized KV cache on MLA layers or in a batch) exits 3 with
  the typed `unsupported_quantization` receipt, whatever the method.
- Model: `--model DIR` or an embedded name, else the embedded trained checkpoint
  (melix_mlx/assets/stdlib-tiny). When that is absent, a tiny RANDOM deepseek_v3
  checkpoint is built once under the cache dir ($MELIX_FSM_CACHE, else
  $XDG_CACHE_HOME/melix-fsm, else ~/.cache/melix-fsm) and used; stderr says so and the
  JSON's `model_source` is "fallback_random_tiny".
- Decoding: melix_mlx.commands.generate_decode (one prompt streamed, several batched).
  With `--vision` or `--image FILE`, a vision-language checkpoint decodes through the
  mlx-vlm adapter instead (melix_mlx.vlm.cli: the same options and outputs, images per row).
  The JSON's "receipt" and "stats" are the library's typed records' own plain data
  (melix_fsm.receipt.Receipt.to_dict, melix_fsm.stats.GenerationStats.to_dict).
- The device policy's calibration is reused from the calibration cache when this model
  was calibrated on this machine before (melix_mlx.decoding.calibration_cache;
  MELIX_FSM_CALIBRATION_CACHE=off measures every start); the receipt's hardware detail
  says so.
- Exit status (melix_fsm.cli): 0 ok; 2 usage error or unreadable input; 3 typed refusal
  of an explicit method, or of a serving context nothing can run, or of `--sharding`
  (`unsupported_sharding`); 4 under `--sharding`, a rank failed or the ranks disagreed
  (melix_mlx.runtime.distributed). mlx is imported inside `run` only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3
PROG = "melix-fsm generate"
EMBEDDED_CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "stdlib-tiny"
FALLBACK_FAMILY = "deepseek_v3"


def register(subparsers: Any) -> None:
    from melix_fsm.commands.options import add_serving_options, add_speculative_options  # no mlx

    parser = subparsers.add_parser(
        "generate",
        help="generate text with MTP (or draft-model) speculative decoding",
        description="Decode one prompt (or a file of prompts, batched) with the checkpoint's MTP head, "
        "a draft model, or plainly. Exit 0 ok, 2 usage error or unreadable input, 3 typed refusal.",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="checkpoint directory or embedded name (stdlib-tiny, stdlib-hybrid; default: stdlib-tiny)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, metavar="TEXT")
    source.add_argument(
        "--prompts-file", default=None, metavar="FILE", help="one prompt per line, or a JSON list"
    )
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N")
    add_speculative_options(parser)
    add_serving_options(parser)
    parser.add_argument("--max-kv-size", type=int, default=None, metavar="N", help="rotating KV cache size")
    parser.add_argument("--prefill-step-size", type=int, default=2048, metavar="N")
    parser.add_argument("--temp", type=float, default=0.0, metavar="T")
    parser.add_argument("--top-p", type=float, default=0.0, metavar="P")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt (with its receipt)")
    parser.add_argument(
        "--receipt", action="store_true", help="also print the full receipt as one JSON line on stderr"
    )
    parser.add_argument("--stagger", type=int, default=0, metavar="N", help="insert one prompt every N steps")
    parser.add_argument(
        "--mtp-sidecar", default=None, metavar="DIR",
        help="MTP head pack for a head-less target, admitted only by its validation contract "
        "(default: <model>/mtp or <model>-mtp when the model has no head)",
    )  # fmt: skip
    parser.add_argument(
        "--sharding", choices=["tensor", "pipeline"], default=None,
        help="under mlx.launch: shard the model over the ranks with mlx-lm's own sharding",
    )  # fmt: skip
    parser.add_argument(
        "--vision", action="store_true",
        help="a vision-language checkpoint through mlx-vlm (docs/vlm.md); a JSON prompts file may then "
        "hold {\"prompt\", \"images\"} objects",
    )  # fmt: skip
    parser.add_argument(
        "--image", action="append", default=None, metavar="FILE",
        help="an image for the prompt (repeatable; implies --vision)",
    )  # fmt: skip
    parser.set_defaults(run=run)


def _fail(message: str, status: int = EXIT_USAGE) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts; raises ValueError (usage) or OSError (unreadable)."""
    if args.prompt is not None:
        return [args.prompt]
    text = Path(args.prompts_file).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise ValueError(f"{args.prompts_file}: a JSON prompts file must be a list of strings")
        prompts = data
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{args.prompts_file}: no prompts")
    return prompts


def _model_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """(checkpoint dir, source): explicit, embedded, or the recorded random fallback."""
    if args.model is not None:
        from melix_mlx.loading.checkpoints import resolve_model

        return resolve_model(args.model), "explicit"
    if (EMBEDDED_CHECKPOINT / "config.json").is_file():
        return EMBEDDED_CHECKPOINT, "embedded"
    from melix_fsm.commands.paths import cache_dir
    from melix_mlx.tools.tiny import make_tiny

    target = cache_dir() / f"tiny-{FALLBACK_FAMILY}"
    if not (target / "config.json").is_file():
        # build beside the target and rename, so an interrupted build is never reused
        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        make_tiny(FALLBACK_FAMILY, partial, seed=0)
        if target.exists():  # another process finished first
            shutil.rmtree(partial, ignore_errors=True)
        else:
            os.replace(partial, target)
    print(
        f"{PROG}: note: embedded checkpoint {EMBEDDED_CHECKPOINT} not found; using a tiny RANDOM "
        f"{FALLBACK_FAMILY} checkpoint at {target} (its text is meaningless)",
        file=sys.stderr,
    )
    return target, "fallback_random_tiny"


def _refused(receipt_data: dict, reason: str, message: str, status: int = EXIT_REFUSED) -> int:
    print(json.dumps({"error": reason, "message": message, "receipt": receipt_data}))
    return _fail(f"{reason}: {message}", status)


def _checked(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """(prompts, mlx-lm KV keyword arguments); raises ValueError/OSError on bad input."""
    from melix_fsm.commands.options import kv_arguments

    from .generate_decode import check_decode_settings

    check_decode_settings(args)
    if args.prefill_step_size <= 0 or (args.max_kv_size is not None and args.max_kv_size <= 0):
        raise ValueError("--prefill-step-size and --max-kv-size must be > 0")
    kv = kv_arguments(args)
    return _read_prompts(args), kv


def run(args: argparse.Namespace) -> int:
    if args.vision or args.image:  # prompts with images: the mlx-vlm adapter (melix_mlx.vlm.cli)
        return _run_vision(args)
    if args.sharding is not None and not getattr(args, "_on_ranks", False):
        from melix_mlx.runtime.distributed import run_ranks  # rank 0 prints; failures end every rank

        args._on_ranks = True
        return run_ranks(lambda: run(args), json_output=args.json, sharding=args.sharding)
    try:
        prompts, kv = _checked(args)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return _fail(str(exc))

    from melix_fsm.commands.options import serving_context
    from melix_fsm.errors import ConfigError

    try:
        config = _speculative_config(args)
    except ConfigError as exc:
        return _fail(str(exc))
    model_dir, model_source = _model_dir(args)
    batched = len(prompts) > 1 or args.batched
    context = serving_context(args, batched=batched)
    first = _receipt_first(args, model_dir, config, context)
    if isinstance(first, int):
        return first
    receipt, machine, preloaded = first
    from melix_mlx.decoding.calibration_cache import default_cache
    from melix_mlx.decoding.startup import StartFailed, StartRefused, start

    def priced_context(tokenizer: Any) -> int:
        # priced at the context the run will hold: a batch is left-padded to its longest prompt
        return max(len(tokenizer.encode(p)) for p in prompts) + args.max_tokens // 2

    try:
        boot = start(
            model_dir,
            config,
            context,
            batch_size=len(prompts),
            eval_context=priced_context,
            sharding=args.sharding,
            receipt=receipt,
            machine=machine,
            preloaded=preloaded,
            calibration_cache=default_cache(),
        )
    except StartRefused as exc:
        return _refused(exc.receipt, exc.reason, exc.message, EXIT_USAGE if exc.usage else EXIT_REFUSED)
    except StartFailed as exc:
        return _fail(str(exc))
    _start_notes(args, boot)
    common = {
        "model": str(model_dir),
        "model_source": model_source,
        "method": config.method.value if boot.head is not None and boot.refusal is None else "none",
        "num_draft_tokens": config.num_draft_tokens,
        "receipt": boot.receipt_data,
        "head_load_error": boot.load_error,
    }
    return _decode_and_print(args, boot, prompts, kv, machine, batched, common)


def _run_vision(args: argparse.Namespace) -> int:
    from melix_fsm.errors import ConfigError
    from melix_mlx.vlm.cli import run as run_vision

    try:
        config = _speculative_config(args)
    except ConfigError as exc:
        return _fail(str(exc))
    return run_vision(args, config, *_model_dir(args))


def _speculative_config(args: argparse.Namespace) -> Any:
    from melix_fsm.config import speculative_config
    from melix_mlx.loading.checkpoints import resolve_model

    draft_dir = str(resolve_model(args.draft_model)) if args.draft_model else None
    return speculative_config(
        profile=args.profile,
        method=args.method,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=draft_dir,
        device_policy=args.device_policy,
    )


def _receipt_first(args: argparse.Namespace, model_dir: Path, config: Any, context: Any) -> tuple | int:
    """(receipt, lifecycle machine, preloaded model or None), or an exit status.

    The receipt comes first: nothing has read a tensor yet (a sidecar pack is the
    exception: its contract loads the target to probe the head)."""
    from melix_fsm.config import Method
    from melix_fsm.lifecycle import SequenceMachine
    from melix_fsm.reasons import RefusalReason
    from melix_fsm.receipt import resolve

    machine = SequenceMachine(0)
    pack = Path(args.mtp_sidecar) if args.mtp_sidecar else None
    receipt = preloaded = None
    if pack is None:
        receipt = resolve(model_dir, config, context=context, machine=machine)
        if config.method is Method.mtp and receipt.refusal_reason is RefusalReason.missing_head_weights:
            from melix_fsm.sidecar import find_pack

            pack = find_pack(model_dir)  # a head-less target: a pack beside it by convention
            machine = SequenceMachine(0) if pack is not None else machine
    if pack is not None:
        if not pack.is_dir():
            return _fail(f"--mtp-sidecar {pack}: not a directory")
        if args.sharding is not None:
            return _fail("--sharding does not load a sidecar head pack; convert it into the checkpoint")
        receipt, preloaded = _resolve_with_pack(model_dir, pack, config, context, machine)
    return receipt, machine, preloaded


def _start_notes(args: argparse.Namespace, boot: Any) -> None:
    """Say on stderr what the start decided where it is not the requested speculation."""
    from melix_fsm.receipt import Mode

    if (boot.refusal is not None and boot.receipt.mode is Mode.refused) or boot.load_error is not None:
        print(f"{PROG}: note: speculation refused ({boot.refusal}); decoding plainly", file=sys.stderr)
    if boot.controller is not None and not boot.speculate:
        note = boot.receipt.message
        print(f"{PROG}: note: {note}; decoding plainly unless the policy resumes", file=sys.stderr)
    if args.receipt:  # else the summary line (and --json results) say how it decoded
        print(f"{PROG}: receipt: {json.dumps(boot.receipt_data, separators=(',', ':'))}", file=sys.stderr)


def _decode_and_print(
    args: argparse.Namespace,
    boot: Any,
    prompts: list[str],
    kv: Any,
    machine: Any,
    batched: bool,
    common: dict[str, Any],
) -> int:
    import mlx.core as mx

    from melix_mlx.loading.errors import UnsupportedServing
    from melix_mlx.runtime.sampling import make_sampler

    from .generate_decode import decode_batched, decode_single

    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    model, tokenizer, head = boot.model, boot.tokenizer, boot.head
    controller, refusal, k = boot.controller, boot.refusal, boot.k
    started = time.perf_counter()
    try:
        if not batched:
            single = decode_single(
                model, tokenizer, head, prompts[0], args, k, sampler, machine, refusal, controller, kv
            )
            results = [single]
        else:
            results = decode_batched(model, tokenizer, head, prompts, args, k, sampler, refusal, controller)
    except UnsupportedServing as exc:  # a batch of a cache mlx-lm cannot merge (DeepSeek-V4.1's)
        return _refused(common["receipt"], exc.reason.value, exc.message)
    except (ValueError, NotImplementedError) as exc:  # an option mlx / mlx-lm reject at decode time
        return _fail(f"decoding failed: {type(exc).__name__}: {exc}")
    wall_s = time.perf_counter() - started
    common["depth"] = controller.k if controller is not None else None  # where the policy left k
    from .generate_summary import emit

    emit(PROG, results, common, wall_s, args.json)
    return EXIT_OK


def _resolve_with_pack(model_dir: Path, pack: Path, config: Any, context: Any, machine: Any) -> tuple:
    """(receipt, (model, tokenizer, head) or None): the target with its head from ``pack``."""
    from melix_mlx.loading.errors import UnvalidatedSidecar
    from melix_mlx.loading.sidecar import load_with_sidecar

    try:
        model, tokenizer, head, info = load_with_sidecar(
            model_dir, pack, speculative=config, context=context, machine=machine
        )
    except UnvalidatedSidecar as exc:
        return exc.receipt, None
    return info.receipt, (model, tokenizer, head)
