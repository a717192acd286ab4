"""``training_report.json``: everything needed to rebuild a checkpoint and judge it.

The exact command, the data (file lists, sizes, a corpus hash), tokenizer and model shape,
the training settings and loss curves, the held-out acceptance, the saved layout, the
load-back verification, file hashes, timings and the software and BLAS that ran.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .data import EOS, EVAL_EVERY, EVAL_OFFSET, Corpus
from .models import Models


def held_out_bytes(corpus: Corpus) -> int:
    return sum(len(s.encode()) for s in corpus.held_texts)


def training_report(
    opts: argparse.Namespace,
    argv: list[str],
    corpus: Corpus,
    models: Models,
    *,
    init_report: dict[str, Any] | None,
    start_dir: Path | None,
    grown_at: list[int] | None,
    main_curve: list[tuple[int, float]],
    head_curve: list[tuple[int, float]],
    held_loss: float,
    chain: str,
    acceptance: dict[str, Any] | None,
    verify: dict[str, Any],
    hashes: dict[str, str],
    timings: dict[str, float],
) -> dict[str, Any]:
    import mlx_lm
    import tokenizers

    return {
        "checkpoint": opts.out.name,
        "command": "python scripts/train_checkpoint.py " + " ".join(argv),
        "init_from": None if init_report is None else {
            "path": str(start_dir),
            "grown": None if grown_at is None else {
                "old_layers_at": grown_at,
                "rule": "the old layers copied in order into these indices; the other layers "
                        "fresh with linear_attn.out_proj / self_attn.o_proj / mlp.down_proj "
                        "zeroed (the grown model equals the old one before training)"},
            "command": init_report["command"],
            "init_from": init_report.get("init_from"),
            "training": {k: init_report["training"][k]
                         for k in ("seed", "steps", "batch", "seq_len", "lr", "main_loss_curve")},
            "note": "the main model continued from (or grew from) this run's main model; "
                    "run its command first, then this one",
        },
        "data": {
            "source": "sysconfig.get_paths()['stdlib'] top-level *.py, sorted, "
                      "minus _sysconfigdata*",
            "stdlib_root": str(corpus.root),
            "held_out_rule": f"index % {EVAL_EVERY} == {EVAL_OFFSET}",
            "train_files": [p.name for p in corpus.train_files],
            "held_out_files": [p.name for p in corpus.held_files],
            "train_bytes": sum(len(s.encode()) for s in corpus.train_texts),
            "held_out_bytes": held_out_bytes(corpus),
            "train_tokens": int(len(corpus.train_ids)),
            "held_out_tokens": int(len(corpus.held_ids)),
            "corpus_sha256": hashlib.sha256(
                b"".join(p.name.encode() + p.read_bytes() for p in corpus.train_files + corpus.held_files)
            ).hexdigest(),
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": corpus.tok.get_vocab_size(),
                      "eos": EOS, "eos_id": corpus.eos_id},
        "model": {"params_main": models.n_main, "params_head_own": models.n_head,
                  "config": models.config},
        "training": {
            "seed": opts.seed, "steps": opts.steps, "head_steps": opts.head_steps,
            "batch": opts.batch, "seq_len": opts.seq_len, "lr": opts.lr,
            "head_lr": opts.head_lr, "optimizer": "AdamW wd=0.01, clip 1.0, warmup+cosine",
            "main_loss_curve": main_curve, "head_loss_curve": head_curve,
            "held_out_main_loss": round(held_loss, 4),
            "head_target": opts.head_target if models.head is not None else None,
            "head_layer": None if models.head is None else ("moe" if opts.moe_head else "dense"),
            "head_moe_bias_balancing_rate": 1e-2 if models.head is not None and opts.moe_head else None,
            "head_init": "from --init-from's head" if opts.init_head else "fresh",
            "head_chain_loss": None if not opts.chain_loss_weight else {
                "weight": opts.chain_loss_weight, "chain": chain,
                "rule": "step-1 loss + weight * step-2 loss; step 2 = the head on its own "
                        "output for pair i and token t_{i+2}, attending to step-1 entries "
                        "0..i, target the main model's argmax at i+2"},
            "head_greedy_pool": None if not opts.head_pool_rows else {
                "rows_per_batch": opts.head_pool_rows, "windows": opts.greedy_pool,
                "prompt_tokens": opts.greedy_prompt,
                "rule": "training-text prompts continued by the main model's own greedy "
                        "tokens"},
        },
        "acceptance": acceptance,
        "layout": {
            "family": opts.family,
            "main": "model.safetensors (HF DeepSeek-V3 names)" if opts.family != "qwen3_5"
                    else "model.safetensors (HF Qwen3.5 names: model.language_model.*, "
                         "conv1d [C, 1, K], (1+w) norms stored as w)",
            "head": None if models.head is None else
                    f"mtp.safetensors, prefix model.layers.{models.args.num_hidden_layers}."
                    if opts.family != "qwen3_5" else
                    "model.safetensors, prefix mtp. ((1+w) norms stored as w)",
            "shared_copies": "embed_tokens and shared_head.head are stored under the head; "
                             "equal to model.embed_tokens and lm_head"
                             if opts.family != "qwen3_5" else
                             "none: the head uses the main embed_tokens and lm_head",
            "dtype": opts.dtype,
        },
        "verify": verify,
        "files_sha256": hashes,
        "timings": timings,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
            "blas": "openblas (LD_PRELOAD)" if "libopenblas" in os.environ.get(
                "LD_PRELOAD", "") else "mlx bundled reference BLAS",
            "cpu_count": os.cpu_count(),
        },
    }
