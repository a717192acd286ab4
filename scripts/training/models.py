"""Building the main model and its head for either family, before any training."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3 as dsv3
from mlx_lm.models import qwen3_5 as q35

from .deepseek_v3 import MTPHead, model_config
from .qwen3_5 import qwen3_5_config, qwen3_5_head


@dataclass
class Models:
    """``whole`` is what is saved (for qwen3_5 the outer ``Model``); ``main`` is trained and
    evaluated (the same arrays); ``head`` is None for a draft model (``--no-head``)."""

    config: dict[str, Any]
    whole: Any
    main: Any
    args: Any
    head: Any | None
    n_main: int
    n_head: int


def build_models(opts: argparse.Namespace, vocab_size: int, eos_id: int) -> Models:
    """Fresh models from ``mx.random`` (seeded by the caller), as the options describe."""
    if opts.family == "qwen3_5":
        config = qwen3_5_config(
            vocab_size, eos_id, layers=opts.layers, hidden=opts.hidden,
            intermediate=opts.intermediate, heads=opts.heads,
            full_attention_interval=opts.full_attention_interval, mtp=not opts.no_head,
        )
        whole: Any = q35.Model(q35.ModelArgs.from_dict(config))
        main_model: Any = whole.language_model  # trained and evaluated; same arrays
        args = main_model.args
        head: Any = qwen3_5_head(main_model)
    else:
        config = model_config(
            vocab_size, eos_id, layers=opts.layers, hidden=opts.hidden,
            intermediate=opts.intermediate, heads=opts.heads, moe_head=opts.moe_head,
            moe_intermediate=opts.moe_intermediate, mtp=not opts.no_head,
        )
        args = dsv3.ModelArgs.from_dict(config)
        main_model = whole = dsv3.Model(args)
        # The head is always constructed (same mx.random draws as with a head, so the main
        # model's init does not depend on --no-head), but only trained and saved with a head.
        head = MTPHead(args)
    mx.eval(main_model.parameters(), head.parameters())
    n_main = sum(v.size for _, v in tree_flatten(main_model.parameters()))
    n_head = sum(v.size for _, v in tree_flatten(head.parameters()))
    if opts.no_head:
        head, n_head = None, 0
    return Models(config, whole, main_model, args, head, n_main, n_head)
