"""`melix-fsm generate --vision`: prompts with images, decoded through the mlx-vlm adapter.

Rules of this module:
- Reached from `melix-fsm generate` when `--vision` or `--image` is given (melix_mlx.commands
  .generate); the text path is untouched. Everything else keeps that command's meaning:
  the model, `--prompt` / `--prompts-file`, `--max-tokens`, the sampling flags, the
  speculative options, `--mtp-sidecar`, `--json` (one object per prompt, with the receipt),
  `--receipt`, `--stagger`, the one-line summary on stderr, the exit codes.
- Images: `--image FILE` (repeatable) goes with every prompt; a JSON prompts file may also
  hold objects `{"prompt": ..., "images": [FILE, ...]}`, each row with its own images (rows
  with and without images in one batch). A prompt without the vision placeholder gets one
  placeholder per image before its text (the raw prompt, as the text path encodes it: no
  chat template); a prompt that writes its placeholders keeps them.
- Decoding: `VLMBatchGenerator` for one prompt or many (one prompt streams its text unless
  --json), run by the text path's own batch loop (melix_mlx.commands.generate_decode
  .drive_batch) with prepared inputs inserted; it stops at the tokenizer's EOS, which the
  tokens exclude, as the text path does.
- Refused as usage errors (exit 2): a draft model, a quantized or rotating KV cache
  (`--kv-bits`, `--max-kv-size`), `--sharding`, an unreadable image, mlx-vlm not
  installed. An explicit `--method mtp` whose head is refused exits 3 with the receipt, as
  the text path does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

PROG = "melix-fsm generate"
EXIT_OK, EXIT_USAGE, EXIT_REFUSED = 0, 2, 3


def _fail(message: str, status: int = EXIT_USAGE) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


def read_rows(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(prompt, image files) per row; raises ValueError (usage) or OSError (unreadable)."""
    given = list(args.image or [])
    if args.prompt is not None:
        return [(args.prompt, given)]
    text = Path(args.prompts_file).read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        rows = [(line, given) for line in text.splitlines() if line.strip()]
    else:
        rows = []
        for entry in json.loads(text):
            if isinstance(entry, str):
                rows.append((entry, given))
            elif isinstance(entry, dict) and isinstance(entry.get("prompt"), str):
                images = entry.get("images", [])
                if not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
                    raise ValueError(f"{args.prompts_file}: a row's images must be a list of file names")
                rows.append((entry["prompt"], given + images))
            else:
                raise ValueError(f"{args.prompts_file}: each entry is a string or {{'prompt', 'images'}}")
    if not rows:
        raise ValueError(f"{args.prompts_file}: no prompts")
    return rows


def _checked(args: argparse.Namespace) -> None:
    from ..commands.generate_decode import check_decode_settings

    check_decode_settings(args)
    if args.sharding is not None:
        raise ValueError("--vision decodes in one process (no --sharding)")
    if args.method == "draft_model" or args.draft_model:
        raise ValueError("--vision decodes with the checkpoint's MTP head (or plainly), not a draft model")
    if args.kv_bits is not None or args.quantized_kv or args.max_kv_size is not None:
        raise ValueError("--vision decodes with a whole, unquantized KV cache (no --kv-bits, --max-kv-size)")


def _open_images(files: list[str]) -> list[Any]:
    from PIL import Image

    out = []
    for name in files:
        try:
            with Image.open(name) as image:
                out.append(image.convert("RGB"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--image {name}: not a readable image ({type(exc).__name__})") from exc
    return out


def _with_placeholders(prompt: str, images: int, placeholder: str, pad: str) -> str:
    if images and pad not in prompt:
        return placeholder * images + prompt
    return prompt


def run(args: argparse.Namespace, speculative_config: Any, model_dir: Path, model_source: str) -> int:
    """Decode the rows of `args` (see the module rules); the exit status."""
    try:
        _checked(args)
        rows = read_rows(args)
        images = [_open_images(files) for _, files in rows]
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return _fail(str(exc))
    import importlib.util

    if importlib.util.find_spec("mlx_vlm") is None:
        return _fail("--vision needs mlx-vlm (pip install 'melix-fsm[vlm]')")
    from mlx_lm.utils import load_config

    from melix_fsm.config import Method, Source

    from . import load_vlm, placeholder, prepare

    try:
        model, processor, head, info = load_vlm(
            model_dir, sidecar=args.mtp_sidecar, speculative=speculative_config
        )
    except Exception as exc:  # noqa: BLE001 - a checkpoint mlx-vlm cannot load (or a refused pack)
        receipt = getattr(exc, "receipt", None)
        if receipt is not None:
            return _refused(receipt, str(exc))
        return _fail(f"cannot load {model_dir} with mlx-vlm: {type(exc).__name__}: {exc}")
    receipt_data = _receipt(info)
    explicit = speculative_config.sources.method is Source.explicit
    if info.refusal is not None and speculative_config.method is Method.mtp and explicit:
        return _refused(info.receipt, info.refusal)
    if info.refusal is not None:
        print(f"{PROG}: note: speculation refused ({info.refusal}); decoding plainly", file=sys.stderr)
    if args.receipt:
        print(f"{PROG}: receipt: {json.dumps(receipt_data, separators=(',', ':'))}", file=sys.stderr)
    tokenizer = processor.tokenizer
    text = placeholder(tokenizer, load_config(Path(model_dir)))
    pad = tokenizer.convert_ids_to_tokens(processor.image_token_id)
    prepared = [
        prepare(model, processor, _with_placeholders(p, len(im), text, pad), im)
        for (p, _), im in zip(rows, images)
    ]
    common = {
        "model": str(model_dir),
        "model_source": model_source,
        "method": "mtp" if head is not None and info.refusal is None else "none",
        "num_draft_tokens": speculative_config.num_draft_tokens,
        "receipt": receipt_data,
        "head_load_error": None,
        "vision_tower": info.vision_tower,
    }
    started = time.perf_counter()
    results = _decode(args, model, processor, head, prepared, speculative_config)
    wall_s = time.perf_counter() - started
    for (prompt, files), result in zip(rows, results):
        result.update(prompt=prompt, images=files)
    from ..commands.generate_summary import emit

    emit(PROG, results, common, wall_s, args.json)
    return EXIT_OK


def _receipt(info: Any) -> dict[str, Any]:
    from melix_fsm.receipt import receipt_json

    return json.loads(receipt_json(info.receipt))


def _refused(receipt: Any, message: str) -> int:
    from melix_fsm.receipt import receipt_json

    data = json.loads(receipt_json(receipt))
    print(json.dumps({"error": data.get("refusal_reason"), "message": message, "receipt": data}))
    return _fail(message, EXIT_REFUSED)


def _decode(
    args: argparse.Namespace, model: Any, processor: Any, head: Any, prepared: list[dict], config: Any
) -> list[dict[str, Any]]:
    """Every row through one VLMBatchGenerator (`--stagger N`: one row joins every N steps)."""
    import mlx.core as mx

    from ..commands.generate_decode import drive_batch
    from ..runtime.sampling import make_sampler
    from .batch import VLMBatchGenerator

    if args.seed is not None:
        mx.random.seed(args.seed)
    tokenizer = processor.tokenizer
    eos = getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    gen = VLMBatchGenerator(
        model,
        head,
        num_draft_tokens=config.num_draft_tokens,
        device_policy=config.device_policy.value,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=args.temp, top_p=args.top_p),
        stop_tokens=[[int(t)] for t in eos if t is not None],
        prefill_step_size=args.prefill_step_size,
    )
    results = [
        {"prompt_tokens": int(p["input_ids"].shape[1]), "tokens": [], "finish_reason": None} for p in prepared
    ]
    stream = len(prepared) == 1 and not args.json

    def insert(rows: list[int]) -> list[int]:
        return gen.insert_inputs([prepared[i] for i in rows])

    def show(token: int) -> None:
        print(tokenizer.decode([token]), end="", flush=True)

    drive_batch(gen, results, insert, args.stagger, on_token=show if stream else None)
    if stream:
        print()
    for result in results:
        result["text"] = tokenizer.decode(result["tokens"])
    return results
