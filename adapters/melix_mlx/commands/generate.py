"""`melix-fsm generate`: decode prompts with the checkpoint's native MTP head.

Rules of this module:
- The receipt (melix_fsm.receipt.resolve) is resolved BEFORE any weight is loaded, and
  its lifecycle machine is the sequence's machine for a single prompt.
- Refusal, fail closed: when `--method mtp` was given explicitly and speculation is
  refused (by the receipt, or by a typed `HeadLoadError` while building the head), the
  command decodes nothing and exits 3 with the receipt (and the load error) as JSON on
  stdout and a one-line reason on stderr. When the method was not given, a refusal
  decodes plainly; the receipt and the reason go into every JSON result and a note to
  stderr, so the fallback is recorded, never silent. `--method none` decodes plainly.
- Model: `--model DIR`, else the embedded trained checkpoint
  (melix_mlx/assets/stdlib-tiny). When that is absent, a tiny RANDOM deepseek_v3
  checkpoint is built once under the cache dir ($MELIX_FSM_CACHE, else
  $XDG_CACHE_HOME/melix-fsm, else ~/.cache/melix-fsm) and used; stderr says so and the
  JSON's `model_source` is "fallback_random_tiny".
- One prompt (`--prompt`, or a prompts file with one entry) goes through
  `mtp_stream_generate`; several run concurrently through `MTPBatchGenerator`, with
  `--stagger N` inserting one prompt every N generator steps (0: all at once).
- Output: text to stdout; with `--json` one JSON object per prompt (one line each) with
  `tokens` (generated ids, the terminating EOS/stop token excluded, as in mlx-lm's
  `generate` / `batch_generate`), `text`, `finish_reason`, `receipt`, `stats`.
- Exit status (melix_fsm.cli): 0 ok; 2 usage error or unreadable input (bad flag
  value, unreadable prompts file or checkpoint); 3 typed refusal of an explicit
  `--method mtp`. mlx is imported inside `run` only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3
PROG = "melix-fsm generate"
EMBEDDED_CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "stdlib-tiny"
FALLBACK_FAMILY = "deepseek_v3"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with native MTP speculative decoding",
        description="Decode one prompt (or a file of prompts, batched) with the checkpoint's MTP head. "
        "Exit 0 ok, 2 usage error or unreadable input, 3 explicit --method mtp refused.",
    )
    parser.add_argument(
        "--model", default=None, metavar="DIR",
        help="checkpoint directory or embedded name (stdlib-tiny, stdlib-hybrid; default: stdlib-tiny)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, metavar="TEXT")
    source.add_argument(
        "--prompts-file", default=None, metavar="FILE", help="one prompt per line, or a JSON list"
    )
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--method", choices=["mtp", "none"], default=None, help="default: mtp (best effort)")
    from melix_fsm.config import int_or_auto  # cheap: no mlx

    parser.add_argument(
        "--num-draft-tokens", type=int_or_auto, default=None, metavar="K|auto", help="auto: chosen live"
    )
    parser.add_argument(
        "--device-policy",
        choices=["auto", "force_on", "force_off"],
        default=None,
        help="auto (default): measure the loaded model and speculate only where it pays",
    )
    parser.add_argument("--temp", type=float, default=0.0, metavar="T")
    parser.add_argument("--top-p", type=float, default=0.0, metavar="P")
    parser.add_argument("--seed", type=int, default=None, metavar="S")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    parser.add_argument("--stagger", type=int, default=0, metavar="N", help="insert one prompt every N steps")
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


def cache_dir() -> Path:
    if os.environ.get("MELIX_FSM_CACHE"):
        return Path(os.environ["MELIX_FSM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "melix-fsm"


def _model_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """(checkpoint dir, source): explicit, embedded, or the recorded random fallback."""
    if args.model is not None:
        from melix_mlx.checkpoints import resolve_model

        return resolve_model(args.model), "explicit"
    if (EMBEDDED_CHECKPOINT / "config.json").is_file():
        return EMBEDDED_CHECKPOINT, "embedded"
    from melix_mlx.tiny import make_tiny

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


def _load_plain(model_dir: Path) -> tuple[Any, Any]:
    from mlx_lm.utils import load_tokenizer

    from melix_mlx.loading import load_main

    model, config = load_main(model_dir)
    return model, load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id", None))


def run(args: argparse.Namespace) -> int:
    if args.max_tokens <= 0:
        return _fail("--max-tokens must be > 0")
    if args.temp < 0 or not 0 <= args.top_p <= 1:
        return _fail("--temp must be >= 0 and --top-p within [0, 1]")
    if args.stagger < 0:
        return _fail("--stagger must be >= 0")
    try:
        prompts = _read_prompts(args)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return _fail(str(exc))

    from melix_fsm.config import Method, Source, speculative_config
    from melix_fsm.errors import ConfigError
    from melix_fsm.lifecycle import Event, SequenceMachine, Signal
    from melix_fsm.reasons import RefusalReason
    from melix_fsm.receipt import Mode, receipt_json, resolve

    try:
        config = speculative_config(
            method=args.method, num_draft_tokens=args.num_draft_tokens, device_policy=args.device_policy
        )
    except ConfigError as exc:
        return _fail(str(exc))
    model_dir, model_source = _model_dir(args)

    # the receipt comes first: nothing has read a tensor yet
    machine = SequenceMachine(0)
    receipt = resolve(model_dir, config, machine=machine)
    receipt_data = json.loads(receipt_json(receipt))
    explicit_mtp = config.method is Method.mtp and config.sources.method is Source.explicit
    reason = receipt.refusal_reason
    if reason is RefusalReason.unreadable_checkpoint:
        print(json.dumps({"error": reason.value, "message": receipt.message, "receipt": receipt_data}))
        return _fail(f"{reason.value}: {receipt.message}")
    refusal: str | None = None
    if receipt.mode is Mode.refused:
        if explicit_mtp:
            print(json.dumps({"error": reason.value, "message": receipt.message, "receipt": receipt_data}))
            return _fail(f"{reason.value}: {receipt.message}", EXIT_REFUSED)
        refusal = f"{reason.value}: {receipt.message}"
        print(f"{PROG}: note: speculation refused ({refusal}); decoding plainly", file=sys.stderr)
    elif receipt.mode is Mode.legacy_only:
        refusal = f"{reason.value}: {receipt.message}"

    from melix_mlx.errors import HeadLoadError
    from melix_mlx.loading import load_with_heads

    head = None
    head_error: dict[str, str] | None = None
    try:
        if refusal is None:
            try:
                model, tokenizer, head, _ = load_with_heads(model_dir)
            except HeadLoadError as exc:
                head_error = {"reason": exc.reason, "message": str(exc)}
                if explicit_mtp:
                    out = {"error": exc.reason, "message": str(exc), "receipt": receipt_data}
                    print(json.dumps(out))
                    return _fail(f"{exc.reason}: {exc}", EXIT_REFUSED)
                refusal = f"{exc.reason}: {exc}"
                print(f"{PROG}: note: MTP head refused ({refusal}); decoding plainly", file=sys.stderr)
                # the receipt admitted this start: the spec's late refusal, on the same machine
                machine.send(Signal(event=Event.refuse, reason=refusal))
                model, tokenizer = _load_plain(model_dir)
        else:
            model, tokenizer = _load_plain(model_dir)
    except (OSError, ValueError, KeyError) as exc:  # a checkpoint mlx-lm cannot read
        return _fail(f"cannot load {model_dir}: {type(exc).__name__}: {exc}")

    import mlx.core as mx

    from melix_mlx.sampling import make_sampler

    controller = None
    if head is not None and refusal is None:
        # measured after loading, before serving: the receipt gains the hardware gate
        from melix_mlx.activation import evaluate

        activation = evaluate(model, head, receipt, config, batch_size=len(prompts))
        receipt_data = json.loads(receipt_json(activation.receipt))
        controller = activation.controller
        if not activation.decision.speculate:
            note = activation.receipt.message
            print(f"{PROG}: note: {note}; decoding plainly unless the policy resumes", file=sys.stderr)

    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    k = config.num_draft_tokens
    if k == "auto":  # the decoders draft up to the deepest k the controller may choose
        k = controller.depth.max_k if controller is not None else 1
    common = {
        "model": str(model_dir),
        "model_source": model_source,
        "method": "mtp" if head is not None and refusal is None else "none",
        "num_draft_tokens": config.num_draft_tokens,
        "receipt": receipt_data,
        "head_load_error": head_error,
    }
    if len(prompts) == 1:
        results = [
            _single(model, tokenizer, head, prompts[0], args, k, sampler, machine, refusal, controller)
        ]
    else:
        results = _batched(model, tokenizer, head, prompts, args, k, sampler, refusal, controller)
    common["depth"] = controller.k if controller is not None else None  # where the policy left k
    for i, result in enumerate(results):
        if args.json:
            print(json.dumps({"index": i, **result, **common}))
        elif len(prompts) > 1:
            print(result["text"])
    sys.stdout.flush()
    return EXIT_OK


def _single(model, tokenizer, head, prompt, args, k, sampler, machine, refusal, controller) -> dict[str, Any]:
    from melix_mlx.generate import mtp_stream_generate

    tokens: list[int] = []
    text = ""
    last = None
    for r in mtp_stream_generate(
        model,
        tokenizer,
        prompt,
        head,
        max_tokens=args.max_tokens,
        num_draft_tokens=k,
        sampler=sampler,
        machine=machine,
        refusal=refusal,
        controller=controller,
    ):
        if r.finish_reason != "stop":
            tokens.append(r.token)
        text += r.text
        if not args.json:
            print(r.text, end="", flush=True)
        last = r
    if not args.json:
        print()
    assert last is not None
    return {
        "prompt": prompt,
        "prompt_tokens": last.prompt_tokens,
        "tokens": tokens,
        "text": text,
        "finish_reason": last.finish_reason,
        "stats": last.stats,
        "prompt_tps": last.prompt_tps,
        "generation_tps": last.generation_tps,
    }


def _batched(model, tokenizer, head, prompts, args, k, sampler, refusal, controller) -> list[dict[str, Any]]:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from melix_mlx.batch_generator import MTPBatchGenerator
    from melix_mlx.generate import encode_prompt

    wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    encoded = [encode_prompt(wrapper, p).tolist() for p in prompts]
    gen = MTPBatchGenerator(
        model,
        head,
        num_draft_tokens=k,
        max_tokens=args.max_tokens,
        sampler=sampler,
        stop_tokens=[[t] for t in wrapper.eos_token_ids],
        refusal=refusal,
        controller=controller,
    )
    results = [
        {"prompt": p, "prompt_tokens": len(e), "tokens": [], "finish_reason": None, "stats": None}
        for p, e in zip(prompts, encoded)
    ]
    index_of: dict[int, int] = {}
    waiting = list(range(len(prompts)))
    done = 0
    step = 0
    while done < len(prompts):
        if waiting and (args.stagger == 0 or step % args.stagger == 0):
            batch = waiting if args.stagger == 0 else waiting[:1]
            for uid, i in zip(gen.insert([encoded[i] for i in batch]), batch):
                index_of[uid] = i
            waiting = waiting[len(batch) :]
        _, generation = gen.next()
        step += 1
        for r in generation:
            result = results[index_of[r.uid]]
            if r.finish_reason != "stop":  # mlx-lm's batch_generate drops the stop token too
                result["tokens"].append(r.token)
            if r.finish_reason is not None:
                result["finish_reason"] = r.finish_reason
                result["stats"] = r.stats
                done += 1
    gen.close()
    for result in results:
        result["text"] = wrapper.decode(result["tokens"])
    return results
