"""Qwen3-Next MTP head: the qwen3_5 head wiring around a Qwen3-Next decoder layer.

Rules:
- ``fc(cat[norm_e(emb), norm_h(h)])`` -> one full-attention layer -> ``norm``; embedding
  first, POST-norm chaining, HF (1+w) norms repaired by +1 once (qwen3_5's ``from_hf``).
- The layer is mlx-lm's own ``Qwen3NextDecoderLayer`` at the first full-attention index,
  so attention (output-gated, partial RoPE) and the MoE block (softmax top-k routed
  experts, sigmoid-gated shared expert) are mlx-lm's, with the main layers' names.
- Released checkpoints store experts one tensor per expert (``experts.{e}.*``); they are
  stacked into ``switch_mlp``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

from . import qwen3_5


class MTPHead(qwen3_5.MTPHead):
    FAMILY: ClassVar[str] = "qwen3_next"

    def _make_block(self, args: Any) -> nn.Module:
        return Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)


is_head_key = qwen3_5.is_head_key
from_hf = qwen3_5.from_hf
