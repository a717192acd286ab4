"""Qwen3.5-MoE MTP head (Qwen3.6-35B-A3B layout): the qwen3_5 head with a sparse-MoE layer.

Rules:
- Wiring, norms (+1 repair of HF's (1+w) storage), key prefixes and chaining are the
  qwen3_5 head's. The head layer is mlx-lm's own ``qwen3_5.DecoderLayer`` built from the
  MoE text config, so its feed-forward is mlx-lm's ``SparseMoeBlock``: softmax-routed
  top-k experts plus a sigmoid-gated shared expert, exactly as the main model's layers.
- Expert tensors arrive fused (``experts.gate_up_proj`` / ``experts.down_proj``, the
  released layout) or per expert; both are stacked into ``switch_mlp``.
"""

from __future__ import annotations

from typing import ClassVar

from . import qwen3_5


class MTPHead(qwen3_5.MTPHead):
    FAMILY: ClassVar[str] = "qwen3_5_moe"


is_head_key = qwen3_5.is_head_key
from_hf = qwen3_5.from_hf
