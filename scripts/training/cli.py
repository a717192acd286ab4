"""The command line, ``python scripts/train_checkpoint.py [options]``: the recipe in order.

Corpus and tokenizer; models (fresh, continued with ``--init-from`` or grown with
``--grow-from``); main-model training; head training and its held-out acceptance; saving
and load-back verification; the training report. ``--seed`` drives ``mx.random`` (init)
and one numpy generator (batches), consumed in this order, so the same seed on the same
machine and BLAS gives the same bytes.

OpenBLAS: mlx's CPU wheel ships reference BLAS (~8x slower here). When Debian's OpenBLAS
exists and is not preloaded, the script re-executes itself with ``LD_PRELOAD`` (disable with
``--no-openblas``). Both paths work; the report records which BLAS ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .data import eval_windows, load_corpus
from .evaluation import eval_main_loss, head_acceptance
from .growth import continue_main, grow_main, init_head
from .head import decoder_chain, greedy_pool, train_head
from .main_model import train_main
from .models import build_models
from .report import held_out_bytes, training_report
from .saving import save_checkpoint, verify_checkpoint

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
SCRIPT = Path(__file__).resolve().parents[1] / "train_checkpoint.py"
DEFAULT_OUT = SCRIPT.parents[1] / "adapters/melix_mlx/assets/stdlib-tiny"
DESCRIPTION = "Train ``stdlib-tiny`` (DeepSeek-V3) or ``stdlib-hybrid`` (Qwen3.5): a trained native MTP head."


def _maybe_reexec_with_openblas(argv: list[str], disabled: bool) -> None:
    """Re-run this process with OpenBLAS preloaded (must happen at process start)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if disabled or "libopenblas" in preload or not os.path.exists(OPENBLAS):
        return
    if os.environ.get("MELIX_TRAIN_REEXEC") == "1":  # guard against an exec loop
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{OPENBLAS}:{preload}" if preload else OPENBLAS
    env["MELIX_TRAIN_REEXEC"] = "1"
    print(f"[train] re-executing with LD_PRELOAD={OPENBLAS}", flush=True)
    os.execve(sys.executable, [sys.executable, *argv], env)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--family", choices=["deepseek_v3", "qwen3_5"], default="deepseek_v3",
                    help="checkpoint layout: DeepSeek-V3 (MLA, eh_proj head) or the Qwen3.5 "
                         "hybrid (GatedDeltaNet + full attention, mtp.* head)")
    ap.add_argument("--full-attention-interval", type=int, default=4,
                    help="qwen3_5: every N-th layer is full attention, the rest linear")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300, help="main-model optimizer steps")
    ap.add_argument("--head-steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--head-lr", type=float, default=5e-3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--head-target", choices=["distill", "soft", "data"], default="distill")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8, help="main decoder layers")
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=512, help="dense MLP width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--moe-head", action="store_true",
                    help="MoE MTP layer (first_k_dense_replace = layers); default dense")
    ap.add_argument("--moe-intermediate", type=int, default=None,
                    help="expert width for --moe-head (default: hidden)")
    ap.add_argument("--no-head", action="store_true",
                    help="train and save the main model only (a draft model)")
    ap.add_argument("--tokenizer-like", type=Path, default=None,
                    help="assert the written tokenizer files equal this checkpoint's")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue training the main model from this checkpoint (same config; "
                         "its training_report.json command ran first); batches are drawn from "
                         "a different stream; the head is trained afresh unless --init-head")
    ap.add_argument("--grow-from", type=Path, default=None,
                    help="qwen3_5: start the main model from this shallower checkpoint (same "
                         "widths): its layers spread in order over the deeper stack, the new "
                         "layers' output projections zeroed (same function at step 0)")
    ap.add_argument("--init-head", action="store_true",
                    help="with --init-from: start the head from that checkpoint's head too "
                         "(with --steps 0 this retrains the head alone on the same main model)")
    ap.add_argument("--chain-loss-weight", type=float, default=0.0,
                    help="add the second draft step (the head chained on its own output, as "
                         "the decoder runs it) to the head loss with this weight")
    ap.add_argument("--head-pool-rows", type=int, default=0,
                    help="rows of each head batch drawn from the main model's own greedy "
                         "continuations of training-text prompts (the text heads draft on)")
    ap.add_argument("--greedy-pool", type=int, default=384,
                    help="size of that pool (windows of seq-len + 1 tokens)")
    ap.add_argument("--greedy-prompt", type=int, default=32,
                    help="training-text prompt tokens at the start of each pool window")
    ap.add_argument("--no-openblas", action="store_true")
    opts = ap.parse_args(argv)
    if opts.init_from is not None and opts.grow_from is not None:
        ap.error("--init-from and --grow-from exclude each other")
    if opts.grow_from is not None and opts.family != "qwen3_5":
        ap.error("--grow-from is implemented for --family qwen3_5")
    if opts.init_head and ((opts.init_from or opts.grow_from) is None or opts.no_head):
        ap.error("--init-head needs --init-from or --grow-from, and a head")
    if not 0 <= opts.head_pool_rows <= opts.batch:
        ap.error("--head-pool-rows must be within 0..--batch")
    return opts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    _maybe_reexec_with_openblas([str(SCRIPT), *argv], opts.no_openblas)
    # Single-threaded tokenizer training keeps merges independent of thread timing.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t_start = time.time()
    timings: dict[str, float] = {}

    def log(msg: str) -> None:
        print(f"[train {time.time() - t_start:6.1f}s] {msg}", flush=True)

    mx.random.seed(opts.seed)
    # A continuation (--init-from) draws other batches than the run it continues.
    rng = np.random.default_rng(
        [opts.seed, 1] if opts.init_from is not None
        else [opts.seed, 2] if opts.grow_from is not None else opts.seed)
    init_report = None
    start_dir = opts.init_from or opts.grow_from
    if start_dir is not None:
        init_report = json.loads((start_dir / "training_report.json").read_text())

    corpus = load_corpus(opts.vocab, timings, log)
    models = build_models(opts, corpus.tok.get_vocab_size(), corpus.eos_id)
    if opts.init_from is not None:
        continue_main(models, opts.init_from, log)
    grown_at: list[int] | None = None
    if opts.grow_from is not None:
        grown_at = grow_main(models, opts.grow_from, opts.full_attention_interval, log)
    if opts.init_head:
        init_head(models, start_dir, opts.family, log)
    log(f"main params {models.n_main}, head params {models.n_head} (+ shared embed/lm_head)")

    t = time.time()
    main_curve = train_main(models.main, corpus.train_ids, steps=opts.steps, batch=opts.batch,
                            length=opts.seq_len, lr=opts.lr, rng=rng, log=log)
    timings["main_train_s"] = round(time.time() - t, 2)

    eval_w = eval_windows(corpus.held_ids, opts.seq_len, opts.eval_windows)
    held_loss = eval_main_loss(models.main, eval_w)
    bits = held_loss * len(corpus.held_ids) / held_out_bytes(corpus) / math.log(2)
    log(f"held-out loss {held_loss:.3f} ({bits:.3f} bits/byte estimate)")

    head_curve: list[tuple[int, float]] = []
    acceptance: dict[str, Any] | None = None
    chain = decoder_chain(opts.family)
    if models.head is not None:
        t = time.time()
        pool = None
        if opts.head_pool_rows:
            pool = greedy_pool(models.main, corpus.train_ids, size=opts.greedy_pool,
                               length=opts.seq_len, prompt=opts.greedy_prompt, rng=rng, log=log)
            timings["greedy_pool_s"] = round(time.time() - t, 2)
        head_curve = train_head(models.head, models.main, corpus.train_ids, steps=opts.head_steps,
                                batch=opts.batch, length=opts.seq_len, lr=opts.head_lr,
                                target=opts.head_target, bias_rate=1e-2, rng=rng, log=log,
                                chain_weight=opts.chain_loss_weight, chain=chain, pool=pool,
                                pool_rows=opts.head_pool_rows)
        timings["head_train_s"] = round(time.time() - t, 2)
        t = time.time()
        acceptance = head_acceptance(models.head, models.main, eval_w, chain, log)
        timings["eval_s"] = round(time.time() - t, 2)

    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[opts.dtype]
    hashes = save_checkpoint(opts.out, models.whole, models.head, models.config, corpus.tok, dtype,
                             opts.family)
    if opts.tokenizer_like is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            mine, theirs = (opts.out / name).read_bytes(), (opts.tokenizer_like / name).read_bytes()
            if mine != theirs:
                raise SystemExit(f"{name} differs from {opts.tokenizer_like / name}")
        log(f"tokenizer files identical to {opts.tokenizer_like}")
    verify = verify_checkpoint(opts.out, models.main, models.head, eval_w)
    log(f"verify: {json.dumps({k: v for k, v in verify.items() if k != 'greedy_sample'})}")
    log(f"greedy sample: {verify['greedy_sample']['completion']!r}")
    timings["total_s"] = round(time.time() - t_start, 2)

    report = training_report(
        opts, argv, corpus, models, init_report=init_report, start_dir=start_dir,
        grown_at=grown_at, main_curve=main_curve, head_curve=head_curve, held_loss=held_loss,
        chain=chain, acceptance=acceptance, verify=verify, hashes=hashes, timings=timings,
    )
    (opts.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {opts.out} in {timings['total_s']:.0f}s")
    return 0
