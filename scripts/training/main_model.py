"""Training the main model: next-token cross-entropy on training-text windows."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models import deepseek_v3 as dsv3

from .data import sample_windows
from .progress import LossCurve


def lr_schedule(peak: float, steps: int, warmup: int) -> Callable:
    warm = optim.linear_schedule(peak * 0.05, peak, warmup)
    decay = optim.cosine_decay(peak, max(1, steps - warmup), end=peak * 0.1)
    return optim.join_schedules([warm, decay], [warmup])


def train_main(
    model: dsv3.Model,
    train: np.ndarray,
    *,
    steps: int,
    batch: int,
    length: int,
    lr: float,
    rng: np.random.Generator,
    log: Callable[[str], None],
) -> list[tuple[int, float]]:
    opt = optim.AdamW(learning_rate=lr_schedule(lr, steps, max(1, min(100, steps // 10))),
                      weight_decay=0.01)

    def loss_fn(m: dsv3.Model, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = grad_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    curve = LossCurve("main", steps, log)
    for it in range(1, steps + 1):
        w = mx.array(sample_windows(train, rng, batch, length))
        loss = step(w[:, :-1], w[:, 1:])
        mx.eval(state, loss)
        curve.add(it, loss.item())
    return curve.points
