"""The registry spec files load, cover the families the project runs, and refuse malformed entries.

Each malformed case edits a deep copy of the real parsed spec so it breaks one rule.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from melix_fsm.errors import SpecError
from melix_fsm.reasons import RefusalReason
from melix_fsm.registry import Support, load_registry, parse_families, parse_rollback, registry
from melix_fsm.spec import spec_dir

FAMILIES = tomllib.loads((spec_dir() / "families.toml").read_text(encoding="utf-8"))
ROLLBACK = tomllib.loads((spec_dir() / "rollback.toml").read_text(encoding="utf-8"))
HEADS_DIR = Path(__file__).resolve().parents[2] / "adapters" / "melix_mlx" / "loading" / "heads"

RUNNABLE = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"}
RUNNABLE |= {"ernie4_5_moe", "longcat_flash", "longcat_flash_ngram"}
RUNNABLE |= {"bailing_moe_v3", "bailing_hybrid"}
RUNNABLE |= {"deepseek_v32", "glm_moe_dsa"}
RUNNABLE |= {"nemotron_h"}
RUNNABLE |= {"mimo_v2_flash", "step3p5", "exaone_moe"}
RUNNABLE |= {"deepseek_v41"}
REFUSED = {
    "kimi_k3",
}


def test_runnable_and_refused_families_are_declared() -> None:
    reg = registry()
    for name in RUNNABLE:
        assert reg.families[name].support is Support.mtp
    for name in REFUSED:
        fam = reg.families[name]
        assert fam.support is Support.refused
        assert fam.refusal is RefusalReason.unsupported_model and name in fam.message


def test_head_modules_exist_in_the_adapters() -> None:
    for fam in registry().families.values():
        if fam.head_module is not None:
            assert (HEADS_DIR / f"{fam.head_module}.py").is_file(), fam.name


def test_runnable_families_have_their_own_head_modules() -> None:
    reg = registry()
    for name in ("qwen3_5_moe", "qwen3_next", "glm4_moe"):
        fam = reg.families[name]
        assert fam.head_module == name


def test_rollback_matrix_covers_every_cell() -> None:
    reg = registry()
    for kind in reg.kinds:
        for q in (False, True):
            for c in (False, True):
                cell = reg.rollback(kind, q, c)
                assert (cell.strategy is None) != (cell.refusal is None)
    assert reg.rollback("arrays", False, False).strategy == "capture_select"
    assert reg.rollback("rotating", False, False).strategy == "window_spare"
    assert reg.rollback("rotating", True, False).refusal is RefusalReason.unsupported_quantization
    assert "rotating" not in reg.unmergeable  # batched windows: melix_mlx.runtime.window_batch
    assert reg.rollback("rotating_keep", False, False).strategy == "window_spare"
    assert reg.unmergeable["rotating_keep"].refusal is RefusalReason.unsupported_cache_sharing


_REFUSED_X = {
    "doc": "A refused family.",
    "support": "refused",
    "model_types": ["refused_x"],
    "refusal": "unsupported_model",
    "message": "refused_x ships a head we do not run",
    "cache_kinds": ["kv"],
}
FAMILY_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("no schema", lambda d: d.pop("schema"), "schema"),
    ("no families", lambda d: d.pop("families"), "families"),
    ("unknown key", lambda d: d["families"]["mimo"].update(colour="red"), "families.mimo"),
    ("bad support", lambda d: d["families"]["mimo"].update(support="maybe"), "families.mimo"),
    ("no head module", lambda d: d["families"]["mimo"].pop("head_module"), "families.mimo.head_module"),
    ("no weights", lambda d: d["families"]["mimo"].pop("weights"), "families.mimo.weights"),
    (
        "bad template",
        lambda d: d["families"]["mimo"]["weights"].update(layer="model.mtp.{k}."),
        "families.mimo.weights.layer",
    ),
    (
        "layer template without layer_count_keys",
        lambda d: d["families"]["deepseek_v3"].update(layer_count_keys=[]),
        "families.deepseek_v3.layer_count_keys",
    ),
    ("duplicate model_type", lambda d: d["families"]["llama"].update(model_types=["mimo"]), "families.llama"),
    ("unknown cache kind", lambda d: d["families"]["mimo"].update(cache_kinds=["paged"]), "families.mimo"),
    (  # a refused entry of the test's own: which shipped families stay refused changes
        "refused without message",
        lambda d: d["families"].update(refused_x={k: v for k, v in _REFUSED_X.items() if k != "message"}),
        "families.refused_x",
    ),
    (
        "refusal not a reason",
        lambda d: d["families"].update(refused_x={**_REFUSED_X, "refusal": "nope"}),
        "families.refused_x",
    ),
    (  # no borrowed layouts: nothing could refuse one (no unvalidated_family reason)
        "layout_of is no key",
        lambda d: d["families"]["glm4_moe"].update(layout_of="deepseek_v3"),
        "families.glm4_moe",
    ),
    (  # every head chains: nothing could refuse a depth (no depth_exceeds_heads reason)
        "chain none",
        lambda d: d["families"]["glm4_moe"].update(chain="none"),
        "families.glm4_moe",
    ),
    ("multi-line doc", lambda d: d["families"]["mimo"].update(doc="a\nb"), "families.mimo.doc"),
    ("no_mtp with head", lambda d: d["families"]["llama"].update(head_module="qwen3_5"), "families.llama"),
]


@pytest.mark.parametrize("edit,entry", [(e, n) for _, e, n in FAMILY_CASES], ids=[c[0] for c in FAMILY_CASES])
def test_malformed_family_entry_names_it(edit: Callable[[dict[str, Any]], None], entry: str) -> None:
    data = copy.deepcopy(FAMILIES)
    edit(data)
    kinds = dict.fromkeys(ROLLBACK["kinds"], "doc")
    with pytest.raises(SpecError) as info:
        parse_families(data, kinds, "families.toml")
    assert info.value.entry.startswith(entry), info.value


N_CELLS = len(ROLLBACK["cells"])  # the last cell is a refusal
ROLLBACK_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing cell", lambda d: d["cells"].pop(0), "kinds.kv"),
    ("duplicate cell", lambda d: d["cells"].append(copy.deepcopy(d["cells"][0])), f"cells[{N_CELLS}]"),
    ("both strategy and refusal", lambda d: d["cells"][0].update(refusal="invalid_config"), "cells[0]"),
    ("unknown strategy", lambda d: d["cells"][0].update(strategy="pray"), "cells[0].strategy"),
    ("unknown kind", lambda d: d["cells"][0].update(kind="paged"), "cells[0].kind"),
    ("refusal not a reason", lambda d: d["cells"][-1].update(refusal="x"), f"cells[{N_CELLS - 1}].refusal"),
    ("bad flag", lambda d: d["cells"][0].update(quantized_kv="yes"), "cells[0].quantized_kv"),
    ("unused strategy", lambda d: d["strategies"].update(spare={"doc": "x"}), "strategies.spare"),
]


@pytest.mark.parametrize(
    "edit,entry", [(e, n) for _, e, n in ROLLBACK_CASES], ids=[c[0] for c in ROLLBACK_CASES]
)
def test_malformed_rollback_cell_names_it(edit: Callable[[dict[str, Any]], None], entry: str) -> None:
    data = copy.deepcopy(ROLLBACK)
    edit(data)
    with pytest.raises(SpecError) as info:
        parse_rollback(data, "rollback.toml")
    assert info.value.entry == entry, info.value


def test_unreadable_registry_file_is_a_spec_error(tmp_path: Path) -> None:
    bad = tmp_path / "families.toml"
    bad.write_text("families = [")
    with pytest.raises(SpecError):
        load_registry(families_path=bad)
