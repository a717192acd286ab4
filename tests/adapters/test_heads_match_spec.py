"""The head modules and spec/families.toml describe the same heads.

The receipt decides from the spec; the loader and the engine run the head modules. If the
two drifted apart a receipt could admit a layout the runtime reads differently. For every
family with its own head module, on its tiny checkpoint in the real Hugging Face layout:

- the module named by `head_module` is the one the runtime maps the family to;
- `CONCAT_ORDER` and `CHAIN_POST_NORM` are the spec's `concat` and `chain`;
- the module's `is_head_key` picks exactly the keys the spec's `[weights]` prefixes name;
- `from_hf` repairs norms exactly as `norm_repair` says ((1 + w) stored as w, or as is).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from melix_mlx.loading.families import text_config
from melix_mlx.loading.heads import FAMILY_MODULES, HEAD_CLASSES
from melix_mlx.tools.tiny import ALL_FAMILIES

from melix_fsm.registry import Chain, NormRepair, Support, registry

OWN_HEADS = [
    name
    for name, fam in registry().families.items()
    if fam.support is Support.mtp and name in ALL_FAMILIES
]


def _matches(key: str, prefix: str) -> bool:
    """The spec's rule: a prefix matches at the start of a key or after a '.'."""
    return key.startswith(prefix) or f".{prefix}" in key


def _raw(path: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


def test_every_runnable_family_is_checked() -> None:
    runnable = {n for n, f in registry().families.items() if f.support is Support.mtp}
    assert set(OWN_HEADS) == runnable, "a runnable family has no tiny fixture to check its layout on"
    assert set(HEAD_CLASSES) == {registry().families[n].head_module for n in runnable}


@pytest.mark.parametrize("family", OWN_HEADS)
def test_head_module_agrees_with_the_spec(tiny_checkpoint, family: str) -> None:
    spec = registry().families[family]
    module = FAMILY_MODULES[spec.head_module]
    head_class = HEAD_CLASSES[spec.head_module]
    assert family == head_class.FAMILY
    assert spec.concat.value == head_class.CONCAT_ORDER
    assert (spec.chain is Chain.post_norm) == head_class.CHAIN_POST_NORM

    path = tiny_checkpoint(family)
    config = json.loads((path / "config.json").read_text())
    tcfg = text_config(config)
    raw = _raw(path)
    layers = next(int(tcfg[k.split(".")[-1]]) for k in spec.layer_count_keys if k.split(".")[-1] in tcfg)
    heads = next(
        (int(tcfg[k.split(".")[-1]]) for k in spec.head_count_keys if k.split(".")[-1] in tcfg),
        spec.head_count_default,
    )
    prefixes = [spec.weights.layer_prefix(j, layers) for j in range(heads)] + list(spec.weights.shared)
    by_spec = {k for k in raw if any(_matches(k, p) for p in prefixes)}
    by_module = {k for k in raw if module.is_head_key(k, tcfg)}
    assert by_spec, f"{family}: the fixture has no head tensors under {prefixes}"
    assert by_module == by_spec

    layer0 = spec.weights.layer_prefix(0, layers)
    norms = {
        k: v for k, v in raw.items() if v.ndim == 1 and k.endswith("norm.weight") and _matches(k, layer0)
    }
    assert norms, f"{family}: no norm in the head's first layer"
    mapped = [v for v in module.from_hf(raw, tcfg, layer=0).values() if v.ndim == 1]
    offset = 1.0 if spec.norm_repair is NormRepair.plus_one else 0.0
    for key, value in norms.items():
        want = value + offset
        assert any(m.shape == want.shape and mx.array_equal(m, want).item() for m in mapped), (
            f"{family}: {key} is not mapped as norm_repair={spec.norm_repair.value} says"
        )
