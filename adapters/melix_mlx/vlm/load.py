"""Load a vision-language checkpoint with mlx-vlm and its MTP head through the registry.

Rules:
- The receipt is ``melix_fsm.receipt.resolve`` on the checkpoint, as for the mlx-lm path
  (same families, same refusals); it is resolved before mlx-vlm loads any weight.
- mlx-vlm loads the model and its processor (its own sanitize drops the head's tensors);
  the head is read from the checkpoint's tensors with the family's own mapping
  (``melix_mlx.loading.head_weights``), or from a sidecar pack through its contract
  (``melix_mlx.loading.sidecar.validate_pack``), and shares the language model's
  embedding and lm_head.
- ``VLMInfo.vision_tower`` notes the tower (its depth and parameter count), or None when the
  checkpoint ships none (mlx-vlm then disables it and only text prompts run).
- A refused receipt loads no head: ``head`` is None and ``info.refusal`` says why; the
  decoders then decode plainly, as they do on the mlx-lm path. A draft model is a
  ValueError (the head slot holds the MTP head or nothing here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_config

from ..loading import head_receipt
from ..loading.checkpoints import resolve_model
from ..loading.errors import UnvalidatedSidecar
from ..loading.families import advertised_head_count, detect_family, text_config
from ..loading.head_weights import build_layer, read_head_weights
from .text import VLMText


@dataclass(frozen=True)
class VLMInfo:
    family: str
    head_layers: int
    vision_tower: str | None  # "<model_type>: depth D, N parameters", or None without one
    sidecar: bool
    receipt: Any
    refusal: str | None


def _tower(vlm: Any, config: dict) -> str | None:
    tower = getattr(vlm, "vision_tower", None)
    params = tree_flatten(tower.parameters()) if tower is not None else []
    if not params:
        return None
    vision = config.get("vision_config") or {}
    count = sum(v.size for _, v in params)
    kind = vision.get("model_type", config.get("model_type"))
    return f"{kind}: depth {vision.get('depth')}, {count} parameters"


def load_vlm(
    path: str | Path,
    *,
    sidecar: str | Path | None = None,
    speculative: Any = None,
    context: Any = None,
    machine: Any = None,
) -> tuple[VLMText, Any, Any, VLMInfo]:
    """``(model, processor, head or None, info)`` for a VL checkpoint run through mlx-vlm.

    ``speculative`` / ``context`` / ``machine``: ``melix_fsm.receipt.resolve``'s (a server
    resolves for a batched context)."""
    from mlx_vlm.utils import load as vlm_load

    from melix_fsm.receipt import resolve

    from ..loading.heads.stacked import StackedHead
    from ..loading.sidecar import validate_pack

    method = getattr(getattr(speculative, "method", None), "value", None)
    if method == "draft_model":  # this adapter fills the head slot with the MTP head or nothing
        raise ValueError("the mlx-vlm adapter decodes with the MTP head (or plainly), not a draft model")
    path = Path(resolve_model(str(path)))
    config = load_config(path)
    family = detect_family(config)
    vlm, processor = vlm_load(str(path))
    model = VLMText(vlm, text_config(config))
    tower = _tower(vlm, config)
    if sidecar is not None:
        result, head = validate_pack(path, Path(sidecar), model, processor.tokenizer, config)
        receipt = resolve(path, speculative, sidecar=result, context=context, machine=machine)
        if head is None or not result.validated:
            raise UnvalidatedSidecar(f"{sidecar}: {result.failure}", report=result, receipt=receipt)
    else:
        receipt = resolve(path, speculative, context=context, machine=machine)
        head = None
        if receipt.mode != "refused":
            layers = list(range(max(advertised_head_count(config), 1)))
            per_layer, _, _ = read_head_weights(path, config, family, layers)
            built = [build_layer(model, family, w, None, path)[0] for w in per_layer.values()]
            head = built[0] if len(built) == 1 else StackedHead(built)
    if head is not None:
        head.eval()
        mx.eval(head.parameters())
        head_receipt.attach(head, receipt)
    info = VLMInfo(
        family=family,
        head_layers=len(getattr(head, "heads", [head])) if head is not None else 0,
        vision_tower=tower,
        sidecar=sidecar is not None,
        receipt=receipt,
        refusal=head_receipt.of_receipt(receipt),
    )
    return model, processor, head, info
