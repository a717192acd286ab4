"""MTP head modules, one per family, and the family -> head-class map.

Head interface (what the decode engine relies on)
-------------------------------------------------
``head = HEAD_CLASSES[family].from_model(main_model)`` (``load_with_heads`` does this and
loads the weights). ``head`` is an ``mlx.nn.Module`` with:

``head(hidden, next_tokens, cache=None, mask=None) -> (logits, head_hidden)``
    hidden       [B, L, D]  the main model's final POST-norm hidden states (the lm_head
                            input; ``hidden.forward_with_hidden`` returns them).
    next_tokens  [B, L]     token t_{i+1} paired with h_i (slot i).
    logits       [B, L, V]  draft distribution for t_{i+2}.
    head_hidden  [B, L, D]  what depth k>1 chains: call the head again with
                            ``(head_hidden, drafted_token)``. Pre- or post-norm per
                            ``CHAIN_POST_NORM``.
    cache        ``head.make_cache()``: a list with one mlx-lm ``KVCache`` per head layer
                 (trimmable with ``cache[0].trim(n)``). Its offset is the RoPE position
                 of the next slot, so prime it from the prompt's (h_i, t_{i+1}) pairs
                 starting at slot 0 and keep it in step with accepted tokens.
    mask         None builds the causal mask over the head cache (mlx-lm rules);
                 pass an explicit one for padded batches.

``head.trunk(hidden, next_tokens, cache=None, mask=None) -> head_hidden`` and
``head.logits(head_hidden) -> logits``: the call in two parts (every family head has
them), so the engine projects to the vocabulary only the slots it draws from: the last
of a prompt's prime (not [n, V] logits for an n-token prompt), the accepted slot of a
cycle's K + 1. A head without them (a draft model in the head slot) is called whole.

``head.at_slot(hidden, next_tokens, cache, at) -> (logits [B, V], head_hidden [B, 1, D])``
(``at`` [B, 1, 1] int32) is what the engine calls: every slot writes the head's cache, one
is read, via ``head.trunk_at``. A ``FusedTrunkHead`` whose block is pre-norm attention then
MLP (``BLOCK_PARTS`` names the four parts; None where the block is not) runs the MLP at that
slot only, so a catch-up over a cycle's K + 1 verified slots pays a MoE head's experts once.

Class constants: ``FAMILY``, ``CHAIN_POST_NORM`` (qwen3_5 / qwen3_5_moe / qwen3_next /
mimo True, deepseek_v3 / glm4_moe / glm4_moe_lite False), ``CONCAT_ORDER`` ("hidden_first" for mimo,
"embedding_first" for the rest), ``NUM_LAYERS`` (layers in the head's cache list: 1).

Every family head is a ``trunk.FusedTrunkHead`` that declares only what differs (weight
names as published, its block, norm and mask conventions, its output head); the steps
the families' ``from_hf`` share live in ``mapping``.

Multi-layer checkpoints load as ``stacked.StackedHead`` (one single-layer head per trained
layer): its ``__call__`` and ``make_cache`` are layer 0's, and ``chain_step(i, hidden,
tokens)`` runs draft step i >= 1 on layer ``min(i, N - 1)``; the engine calls
``chain_step`` when a head has one. A block drafter (deepseek_v41's DSpark) is one head over
all its stages (its module sets ``STAGES_FORM_ONE_HEAD``): ``logits`` at the slot drafted
from runs the block pass, ``chain_step(i, ...)`` serves draft i from that block; it reads
intermediate trunk layers through ``runtime.hidden``'s declared taps.

The embedding and (except DeepSeek's own ``shared_head.head``) the lm_head are the main
model's modules, held by reference, outside ``head.parameters()``.

Each family module also exposes ``is_head_key(key, config)`` (raw checkpoint key belongs
to an MTP layer) and ``from_hf(raw, config, layer=0)`` (raw HF tensors -> head parameter
names, with the family's repairs: qwen3_5 +1 norms, deepseek fp8/expert/kv_b handling).
"""

from __future__ import annotations

from types import ModuleType

from . import (
    bailing_hybrid,
    bailing_moe_v3,
    deepseek_v3,
    deepseek_v32,
    deepseek_v41,
    ernie4_5_moe,
    exaone_moe,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    longcat_flash,
    longcat_flash_ngram,
    mimo,
    mimo_v2_flash,
    nemotron_h,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    step3p5,
)
from ._base import MTPHeadBase

FAMILY_MODULES: dict[str, ModuleType] = {
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe,
    "qwen3_next": qwen3_next,
    "deepseek_v3": deepseek_v3,
    "glm4_moe": glm4_moe,
    "glm4_moe_lite": glm4_moe_lite,
    "mimo": mimo,
    "mimo_v2_flash": mimo_v2_flash,
    "exaone_moe": exaone_moe,
    "step3p5": step3p5,
    "bailing_moe_v3": bailing_moe_v3,
    "bailing_hybrid": bailing_hybrid,
    "deepseek_v32": deepseek_v32,
    "glm_moe_dsa": glm_moe_dsa,
    "ernie4_5_moe": ernie4_5_moe,
    "longcat_flash": longcat_flash,
    "longcat_flash_ngram": longcat_flash_ngram,
    "nemotron_h": nemotron_h,
    "deepseek_v41": deepseek_v41,
}

HEAD_CLASSES: dict[str, type[MTPHeadBase]] = {name: module.MTPHead for name, module in FAMILY_MODULES.items()}

__all__ = ["FAMILY_MODULES", "HEAD_CLASSES", "MTPHeadBase"]
