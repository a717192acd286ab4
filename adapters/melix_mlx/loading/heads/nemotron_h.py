"""Nemotron-H MTP head: ``eh_proj(cat[enorm(emb), hnorm(h)])`` -> the head's own sub-layer
stack -> ``final_layernorm`` -> the shared lm_head.

Rules (facts from vLLM's ``nemotron_h_mtp.py``, mlx-vlm 0.7.10's ``nemotron_h_mtp``
drafter and published Nemotron-3 checkpoints):
- Weight names as published: ``mtp.layers.{i}.*`` for the sub-layers i = 0..P-1 of the one
  prediction module (``num_nextn_predict_layers`` = 1; ``language_model.`` in front in
  the multimodal wrappers). The sub-layer kinds are the config's
  ``mtp_hybrid_override_pattern`` (e.g. ``"*E"``) or, in newer configs,
  ``mtp_layers_block_type`` (e.g. ``["attention", "moe"]``). Each sub-layer is a
  Nemotron-H block, ``x + mixer(norm(x))``: ``norm`` and ``mixer.*`` (attention
  ``q_proj``/``k_proj``/``v_proj``/``o_proj``, no RoPE; or MoE ``gate.weight``,
  ``gate.e_score_correction_bias``, ``experts.{e}.{up,down}_proj``, ``shared_experts``,
  optionally ``fc1_latent_proj``/``fc2_latent_proj``). The first sub-layer also holds
  ``enorm``, ``hnorm`` and ``eh_proj``; the last one ``final_layernorm``. mlx-lm's
  ``nemotron_h.sanitize`` drops every ``mtp.`` key (line 561).
- Parameters here: ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` at the top,
  ``layers.{i}`` = mlx-lm's own ``NemotronHBlock`` (so attention, the squared-ReLU
  experts with their sigmoid router and the shared expert are mlx-lm's numerics);
  per-expert tensors are stacked into ``switch_mlp.fc1`` (up) / ``fc2`` (down) as
  mlx-lm's sanitize does for the main layers.
- Norms are plain RMSNorm weights (no +1). Concatenation is embedding FIRST. The head
  reads the main model's POST-norm hidden (``norm_f`` output, the lm_head input), and
  returns ``final_layernorm``'s output, which the shared main lm_head projects; depth
  k > 1 runs the same module again on that POST-norm output (vLLM's and mlx-vlm's
  chaining). The embedding is the main ``backbone.embeddings``.
- The head's cache list holds one KVCache per attention sub-layer (MoE and MLP layers
  hold none); every attention sub-layer sees the same causal mask, built from the first.
- A Mamba sub-layer (``M``) in the head pattern would need its own recurrent head cache:
  no published head has one, and it is refused as ``UnsupportedModel``.
- The sub-layer pattern of a loaded head is read from its tensors (``from_weights``), so
  raw and converted directories build the same head (``from_model``: the published "*E"); ``from_hf``
  checks the tensors against the config's pattern (``HeadShapeMismatch`` otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock

from ..errors import HeadShapeMismatch, UnsupportedModel
from . import mapping
from .trunk import FusedTrunkHead

_PREFIXES = ("mtp.", "language_model.mtp.", "model.language_model.mtp.")
_FIRST = ("enorm.", "hnorm.", "eh_proj.")  # on sub-layer 0 in the checkpoint
_LAST = ("final_layernorm.",)  # on sub-layer P - 1
_KINDS = "*E-"  # attention, MoE, MLP sub-layers; "M" (Mamba) is refused
PUBLISHED_PATTERN = "*E"
_EXPERTS = (("up_proj", "fc1"), ("down_proj", "fc2"))  # mlx-lm's switch_mlp names
_LAYER = re.compile(r"^layers\.(\d+)\.mixer\.([a-z_0-9]+)")


def _check_pattern(pattern: str) -> str:
    if not pattern or any(c not in _KINDS for c in pattern):
        raise UnsupportedModel(
            f"nemotron_h MTP sub-layer pattern {pattern!r}: only attention ('*'), MoE ('E') "
            "and MLP ('-') sub-layers run here (a Mamba sub-layer would need a recurrent head cache)",
            details={"pattern": pattern},
        )
    return pattern


def config_pattern(config: dict[str, Any]) -> str:
    """The head's sub-layer pattern from a config.json dict (``*``/``E``/``-``/``M``)."""
    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None and config.get("mtp_layers_block_type") is not None:
        to_char = ModelArgs._block_type_to_char  # mlx-lm's names for the block kinds
        kinds = list(config["mtp_layers_block_type"])
        unknown = [k for k in kinds if k not in to_char]
        if unknown:
            raise UnsupportedModel(
                f"nemotron_h mtp_layers_block_type {unknown} unknown", details={"kinds": kinds}
            )
        pattern = "".join(to_char[k] for k in kinds)
    return _check_pattern("".join(pattern) if pattern is not None else PUBLISHED_PATTERN)


def weights_pattern(weights: dict[str, mx.array]) -> str:
    """The sub-layer pattern the head tensors hold (``layers.{i}.mixer.<first part>``)."""
    kinds: dict[int, str] = {}
    for key in weights:
        m = _LAYER.match(key)
        if m is None:
            continue
        part = m.group(2)
        kind = {"q_proj": "*", "gate": "E", "switch_mlp": "E", "up_proj": "-", "in_proj": "M"}.get(part)
        if kind is not None:
            kinds[int(m.group(1))] = kind
    if sorted(kinds) != list(range(len(kinds))):
        raise HeadShapeMismatch(
            f"nemotron_h head sub-layers {sorted(kinds)} are not 0..P-1", details={"layers": sorted(kinds)}
        )
    return "".join(kinds[i] for i in range(len(kinds)))


class MTPHead(FusedTrunkHead):
    FAMILY: ClassVar[str] = "nemotron_h"
    CHAIN_POST_NORM: ClassVar[bool] = True  # final_layernorm's output, chained as is
    CONCAT_ORDER: ClassVar[str] = "embedding_first"
    BLOCK, FINAL_NORM = "layers", "final_layernorm"
    BLOCK_PARTS: ClassVar[tuple[str, str, str, str] | None] = None  # a stack of sub-layers (_run_block)
    EPS: ClassVar[str] = "layer_norm_epsilon"

    def __init__(
        self,
        args: Any,
        embed_tokens: nn.Module,
        lm_head: Callable[[mx.array], mx.array],
        pattern: str = PUBLISHED_PATTERN,
        **kwargs: Any,
    ) -> None:
        self.pattern = _check_pattern(pattern)  # read by _make_layers, inside the base's __init__
        super().__init__(args, embed_tokens, lm_head, **kwargs)
        self.NUM_LAYERS = pattern.count("*")  # caches: one per attention sub-layer

    @classmethod
    def from_weights(
        cls, model: nn.Module, weights: dict[str, mx.array], *, own_lm_head: bool = False
    ) -> MTPHead:
        """A head wired to `model` whose sub-layers are the ones `weights` hold."""
        from ...runtime.hidden import main_parts

        parts = main_parts(model)
        return cls(parts.args, parts.embed_tokens, parts.lm_head, pattern=weights_pattern(weights))

    def _make_layers(self, args: Any) -> list[nn.Module]:
        return [NemotronHBlock(args, kind) for kind in self.pattern]

    def _run_block(self, x: mx.array, mask: Any, cache: list[Any] | None) -> mx.array:
        # every attention sub-layer takes the next cache and the shared mask; the rest neither
        caches = iter(cache or [])
        for layer in self.layers:
            attends = layer.block_type == "*"
            x = layer(x, mask=mask if attends else None, cache=next(caches, None) if attends else None)
        return x


def _strip(key: str) -> str | None:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return None


def is_head_key(key: str, config: dict[str, Any]) -> bool:
    return _strip(key) is not None


def from_hf(raw: dict[str, mx.array], config: dict[str, Any], layer: int = 0) -> dict:
    """Map raw HF tensors of prediction module ``layer`` to ``MTPHead`` parameter names."""
    pattern = config_pattern(config)
    first, size = layer * len(pattern), len(pattern)
    out: dict[str, mx.array] = {}
    for key, value in raw.items():
        name = _strip(key)
        if name is None or not name.startswith("layers.") or "rotary_emb.inv_freq" in name:
            continue
        index, _, rest = name[len("layers.") :].partition(".")
        i = int(index) - first
        if not 0 <= i < size:
            continue
        if (i == 0 and rest.startswith(_FIRST)) or (i == size - 1 and rest.startswith(_LAST)):
            out[rest] = value
        else:
            out[f"layers.{i}.{rest}"] = value
    for i, kind in enumerate(pattern):
        if kind == "E":
            mapping.stack_experts(
                out, f"layers.{i}.mixer", int(config.get("n_routed_experts") or 0), _EXPERTS
            )
    if out and weights_pattern(out) != pattern:
        raise HeadShapeMismatch(
            f"nemotron_h head tensors hold sub-layers {weights_pattern(out)!r}, the config says {pattern!r}",
            details={"tensors": weights_pattern(out), "config": pattern},
        )
    return out
