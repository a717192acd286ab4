"""Training the MTP head by self-distillation against the frozen main model.

The target at pair i is the main model's argmax at i+1 (``--head-target distill``; ``soft``
is its whole distribution, ``data`` the token t_{i+2}). Depth 2 (``--chain-loss-weight``)
trains the decoder's second draft step for all pairs at once: the head on its own output
(the family head class's ``CHAIN_POST_NORM``) and token t_{i+2}, the chained entries at
RoPE position i + 1 attending to the first step's entries 0..i plus their own.
``--head-pool-rows`` draws rows from the main model's own greedy continuations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models import deepseek_v3 as dsv3
from mlx_lm.models.base import create_attention_mask

from .data import sample_windows
from .deepseek_v3 import MTPHead, head_logits
from .evaluation import greedy_continue
from .main_model import lr_schedule
from .progress import LossCurve


def decoder_chain(family: str) -> str:
    """The hidden the project's decoder chains at depth > 1 for ``family``: "post" (after
    the head's final norm) or "pre" (the head layer's output), from the head class itself."""
    from melix_mlx.loading.heads import HEAD_CLASSES

    return "post" if HEAD_CLASSES[family].CHAIN_POST_NORM else "pre"


class KeyTap:
    """A stand-in head cache for training's first draft step: RoPE offset 0, records the
    keys and values it is handed so the chained step can attend to them."""

    offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values


class ChainedCache:
    """The head cache as the decoder's second draft step sees it, for all positions at once:
    the chained entry for pair i sits at RoPE position i + 1 (offset 1 for a sequence
    starting at pair 0) and attends to the first step's entries 0..i plus itself
    (``chain_mask``)."""

    offset = 1

    def __init__(self, tap: KeyTap) -> None:
        self.tap = tap

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return (mx.concatenate([self.tap.keys, keys], axis=2),
                mx.concatenate([self.tap.values, values], axis=2))


def chain_mask(first: int, second: int) -> mx.array:
    """[second, first + second] boolean: chained query i sees first-step keys 0..i and its
    own key (first + i)."""
    rows = np.arange(second)[:, None]
    seen = np.concatenate([np.arange(first)[None, :] <= rows,
                           np.arange(second)[None, :] == rows], axis=1)
    return mx.array(seen)


def greedy_pool(
    main: Any, train: np.ndarray, *, size: int, length: int, prompt: int,
    rng: np.random.Generator, log: Callable[[str], None], chunk: int = 32,
) -> np.ndarray:
    """``size`` windows of ``length + 1`` tokens: a training-text prompt of ``prompt``
    tokens continued by the main model's own greedy tokens, the text a head drafts on
    at inference. Prompts come from the training files only."""
    rows = []
    for i in range(0, size, chunk):
        n = min(chunk, size - i)
        starts = rng.integers(0, len(train) - prompt, size=n)
        prompts = np.stack([train[s : s + prompt] for s in starts])
        seqs = greedy_continue(main, mx.array(prompts), length + 1 - prompt)
        rows.append(np.array(seqs[:, : length + 1]))
        log(f"greedy pool {i + n}/{size}")
    return np.concatenate(rows).astype(np.int32)


def train_head(
    head: MTPHead,
    main: dsv3.Model,
    train: np.ndarray,
    *,
    steps: int,
    batch: int,
    length: int,
    lr: float,
    target: str,
    bias_rate: float,
    rng: np.random.Generator,
    log: Callable[[str], None],
    chain_weight: float = 0.0,
    chain: str = "pre",
    pool: np.ndarray | None = None,
    pool_rows: int = 0,
) -> list[tuple[int, float]]:
    """Self-distillation: the frozen main model supplies h_i and the target at i+1.

    ``chain_weight > 0`` adds the second draft step as the decoder runs it: the head's own
    output for pair i (``chain`` "pre" or "post" its final norm) with token t_{i+2}, attending
    to the first step's entries 0..i, trained on the main model's argmax at i+2; the loss is
    step-1 loss + chain_weight * step-2 loss. ``pool_rows`` of each batch come from
    ``pool`` (the main model's greedy continuations), the rest from training text."""
    if chain_weight and target != "distill":
        raise SystemExit("--chain-loss-weight needs --head-target distill")
    main.freeze()
    mlp = getattr(head, "mlp", None)  # a DeepSeek-V3 head layer; Qwen3.5 nests its layer
    gate = mlp.gate if isinstance(mlp, dsv3.DeepseekV3MoE) else None
    if gate is not None:
        # Aux-loss-free balancing (DeepSeek-V3): the bias is moved by load, not by gradients.
        gate.freeze(keys=["e_score_correction_bias"])
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps, max(1, min(50, steps // 10))),
                      weight_decay=0.01)
    second_mask = chain_mask(length, length - 1)

    def layer(hd: MTPHead, h: mx.array, emb: mx.array, cache: Any, mask: mx.array | None):
        """The head's pre-norm output, and the routed MLP's input (DeepSeek-V3 MoE head:
        recomputed explicitly so the router's load is visible)."""
        if gate is None:
            return hd.hidden(h, emb, cache, mask), None
        x = hd.eh_proj(mx.concatenate([hd.enorm(emb), hd.hnorm(h)], axis=-1))
        if mask is None:
            mask = create_attention_mask(x, None, return_array=True)
        x = x + hd.self_attn(hd.input_layernorm(x), mask, cache)
        xn = hd.post_attention_layernorm(x)
        return x + hd.mlp(xn), xn

    def loss_fn(hd: MTPHead, w: mx.array) -> tuple[mx.array, mx.array]:
        h = mx.stop_gradient(main.model(w))  # post-norm hidden, (B, T, D)
        greedy = None
        if target == "distill":
            greedy = mx.stop_gradient(mx.argmax(main.lm_head(h), axis=-1))  # [j] -> t_{j+1}
            tgt = greedy[:, 1:]
        elif target == "soft":  # the main model's whole next-token distribution
            tgt = mx.stop_gradient(mx.softmax(main.lm_head(h[:, 1:]), axis=-1))
        else:
            tgt = w[:, 2:]
        tap = KeyTap() if chain_weight else None
        x, xn = layer(hd, h[:, :-1], main.model.embed_tokens(w[:, 1:]), tap, None)
        logits = head_logits(hd, main, x)
        # Distillation has a target for all T pairs; the data token t_{i+2} for T-1.
        if target in ("distill", "soft"):
            loss = nn.losses.cross_entropy(logits, tgt, reduction="mean")
        else:
            loss = nn.losses.cross_entropy(logits[:, :-1], tgt, reduction="mean")
        if chain_weight:
            fed = hd.shared_head.norm(x) if chain == "post" else x
            x2, _ = layer(hd, fed[:, :-1], main.model.embed_tokens(w[:, 2:]),
                          ChainedCache(tap), second_mask)
            loss2 = nn.losses.cross_entropy(head_logits(hd, main, x2), greedy[:, 2:],
                                            reduction="mean")
            loss = loss + chain_weight * loss2
        if gate is None:
            return loss, mx.zeros((1,))
        inds, _ = hd.mlp.gate(xn)
        load = (inds[..., None] == mx.arange(gate.n_routed_experts)).sum(axis=(0, 1, 2))
        return loss, load.astype(mx.float32)

    grad_fn = nn.value_and_grad(head, loss_fn)
    state = [head.state, opt.state]

    def step(w: mx.array) -> mx.array:
        (loss, load), grads = grad_fn(head, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        if gate is not None:
            gate.e_score_correction_bias = gate.e_score_correction_bias + bias_rate * mx.sign(
                load.mean() - load
            )
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    curve = LossCurve("head", steps, log)
    pool_rows = pool_rows if pool is not None else 0
    for it in range(1, steps + 1):
        rows = sample_windows(train, rng, batch - pool_rows, length)
        if pool_rows:
            rows = np.concatenate([rows, pool[rng.integers(0, len(pool), size=pool_rows)]])
        loss = step(mx.array(rows))
        mx.eval(state, loss)
        curve.add(it, loss.item())
    main.unfreeze()
    return curve.points
