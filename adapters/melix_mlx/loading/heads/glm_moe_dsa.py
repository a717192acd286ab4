"""GLM-5 (glm_moe_dsa) MTP head: deepseek_v32's head, as mlx-lm builds the family.

Rules:
- mlx-lm builds glm_moe_dsa as deepseek_v32 (its ``Model`` subclasses it; only the
  config differs: ``rope_parameters`` carries ``rope_theta``, the indexer's RoPE is
  interleaved by default). The MTP layer at ``model.layers.{num_hidden_layers + j}`` is
  the same: ``enorm``, ``hnorm``, ``eh_proj`` (embedding first), a DSA decoder layer
  with its own indexer, ``shared_head.{norm, head}``; plain RMSNorms; reads the main
  model's POST-norm hidden state; chains the PRE-norm layer output (deepseek_v3's
  convention, as vLLM runs GLM's DeepSeek-style MTP; mlx-vlm 0.7.10's GLM drafter chains
  the ``shared_head.norm`` output instead, which only changes what depth >= 2 drafts).
- Weights map through deepseek_v3's ``from_hf``.
"""

from __future__ import annotations

from typing import ClassVar

from . import deepseek_v3, deepseek_v32


class MTPHead(deepseek_v32.MTPHead):
    FAMILY: ClassVar[str] = "glm_moe_dsa"


is_head_key = deepseek_v3.is_head_key
from_hf = deepseek_v3.from_hf
