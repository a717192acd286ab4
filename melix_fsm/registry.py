"""The family capability registry (spec/families.toml) and rollback matrix (spec/rollback.toml).

Rules of this module:
- The registry is data. No family, prefix, cache kind or strategy is written here; this
  module only loads the two spec files into frozen msgspec Structs and checks them.
- A malformed entry is refused at load time with a `SpecError` naming it
  (`families.<name>.<key>`, `cells[<i>]`); a half-valid registry is never returned.
- Lookups never guess: a model_type maps to exactly one family or to none.
- No mlx, no file access beyond the two spec files.
"""

from __future__ import annotations

import enum
import string
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from .errors import SpecError
from .reasons import RefusalReason
from .spec import read_toml, spec_dir


class Support(enum.StrEnum):
    mtp = "mtp"  # native heads we run
    refused = "refused"  # native heads we do not run (typed refusal)
    no_mtp = "no_mtp"  # no native head at all


class Concat(enum.StrEnum):
    embedding_first = "embedding_first"
    hidden_first = "hidden_first"


class NormRepair(enum.StrEnum):
    plus_one = "plus_one"
    none = "none"


class Chain(enum.StrEnum):
    """How a head drafts depth k > 1: it runs again on its own hidden output (every
    runnable family can, so any depth is admitted; there is no "cannot chain")."""

    pre_norm = "pre_norm"
    post_norm = "post_norm"


class WeightLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a head's tensors live (key prefixes, see spec/families.toml)."""

    layer: str
    layer_required: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()

    @property
    def uses_layer_count(self) -> bool:
        return "{layer}" in self.layer

    def layer_prefix(self, j: int, layer_count: int) -> str:
        return self.layer.format(j=j, layer=layer_count + j)


class Family(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registry entry. Fields that only "mtp" entries use are None otherwise."""

    doc: str
    support: Support
    model_types: tuple[str, ...]
    cache_kinds: tuple[str, ...]
    name: str = ""  # filled from the table key
    runs: str = ""  # the checkpoints people run under this family (the docs' family table)
    head_module: str | None = None
    validated: bool = False
    head_count_keys: tuple[str, ...] = ()
    head_count_default: int = 0  # head layers when no head_count_keys key is present
    layer_count_keys: tuple[str, ...] = ()
    concat: Concat | None = None
    norm_repair: NormRepair | None = None
    chain: Chain | None = None
    quantized_matmul: bool = False
    quantized_kv_cache: bool = True  # False for MLA: the latent cache cannot be quantized
    batch_reshape: bool = False
    sliding_layer_types: bool = False  # mlx-lm windows the layers layer_types marks sliding
    weights: WeightLayout | None = None
    refusal: RefusalReason | None = None
    message: str = ""


class SidecarMarkers(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    doc: str
    model_type_suffixes: tuple[str, ...] = ()
    architecture_markers: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()


class RollbackCell(msgspec.Struct, frozen=True):
    kind: str
    quantized_kv: bool
    chunked_prefill: bool
    strategy: str | None
    refusal: RefusalReason | None
    message: str


class Unmergeable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A cache kind mlx-lm cannot merge into a batch cache, and the refusal a batch gets."""

    kind: str
    refusal: RefusalReason
    message: str


class Registry(msgspec.Struct, frozen=True):
    families: dict[str, Family]
    model_types: dict[str, str]  # model_type -> family name
    sidecar: SidecarMarkers
    kinds: dict[str, str]  # cache kind -> doc
    strategies: dict[str, str]  # strategy -> doc
    cells: dict[tuple[str, bool, bool], RollbackCell]
    unmergeable: dict[str, Unmergeable] = {}  # cache kind -> why a batch cannot hold it

    def family_for(self, model_type: str) -> Family | None:
        name = self.model_types.get(model_type)
        return None if name is None else self.families[name]

    def rollback(self, kind: str, quantized_kv: bool, chunked_prefill: bool) -> RollbackCell:
        return self.cells[(kind, quantized_kv, chunked_prefill)]


def _convert(path: str, entry: str, data: Any, typ: type) -> Any:
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as exc:
        raise SpecError(path, entry, str(exc)) from None


def _doc_ok(path: str, entry: str, doc: str) -> None:
    if not doc.strip() or "\n" in doc.strip():
        raise SpecError(path, entry, "needs a one-line doc string")


def _check_template(path: str, entry: str, template: str) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise SpecError(path, entry, f"bad prefix template {template!r}: {exc}") from None
    if not fields or not fields <= {"j", "layer"}:
        raise SpecError(path, entry, f"template {template!r} must use {{j}} or {{layer}} and nothing else")


def _check_mtp(path: str, where: str, fam: Family) -> None:
    for key in ("head_module", "concat", "norm_repair", "chain", "weights"):
        if getattr(fam, key) is None:
            raise SpecError(path, f"{where}.{key}", "is required when support = 'mtp'")
    if not fam.head_count_keys:
        raise SpecError(path, f"{where}.head_count_keys", "is required when support = 'mtp'")
    assert fam.weights is not None
    _check_template(path, f"{where}.weights.layer", fam.weights.layer)
    if fam.weights.uses_layer_count and not fam.layer_count_keys:
        raise SpecError(path, f"{where}.layer_count_keys", "is required by a {layer} template")
    if fam.refusal is not None:
        raise SpecError(path, f"{where}.refusal", "only 'refused' entries carry a refusal")


def parse_families(data: dict[str, Any], kinds: dict[str, str], path: str = "<families>") -> tuple:
    schema = data.get("schema")
    if not isinstance(schema, str):
        raise SpecError(path, "schema", "missing schema id string")
    sidecar = _convert(path, "sidecar", data.get("sidecar"), SidecarMarkers)
    _doc_ok(path, "sidecar.doc", sidecar.doc)
    tables = data.get("families")
    if not isinstance(tables, dict) or not tables:
        raise SpecError(path, "families", "missing or empty")
    families: dict[str, Family] = {}
    model_types: dict[str, str] = {}
    for name, table in tables.items():
        where = f"families.{name}"
        if not isinstance(table, dict):
            raise SpecError(path, where, "must be a table")
        if "name" in table:
            raise SpecError(path, f"{where}.name", "is the table key; do not set it")
        fam = _convert(path, where, {**table, "name": name}, Family)
        _doc_ok(path, f"{where}.doc", fam.doc)
        if not fam.model_types:
            raise SpecError(path, f"{where}.model_types", "must list at least one model_type")
        for mt in fam.model_types:
            if mt in model_types:
                raise SpecError(
                    path, f"{where}.model_types", f"{mt!r} is already claimed by {model_types[mt]!r}"
                )
            model_types[mt] = name
        if not fam.cache_kinds:
            raise SpecError(path, f"{where}.cache_kinds", "must list at least one cache kind")
        for kind in fam.cache_kinds:
            if kind not in kinds:
                raise SpecError(path, f"{where}.cache_kinds", f"names unknown cache kind {kind!r}")
        if fam.support is Support.mtp:
            _check_mtp(path, where, fam)
        elif fam.support is Support.refused:
            if fam.refusal is None or not fam.message.strip():
                raise SpecError(path, where, "a 'refused' entry needs a refusal reason and a message")
        elif fam.refusal is not None or fam.head_module is not None:
            raise SpecError(path, where, "a 'no_mtp' entry has no head_module and no refusal")
        families[name] = fam
    return schema, families, model_types, sidecar


def _bools(path: str, entry: str, value: Any) -> list[bool]:
    if isinstance(value, bool):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        return value
    raise SpecError(path, entry, "must be true, false or a non-empty list of them")


def parse_rollback(data: dict[str, Any], path: str = "<rollback>") -> tuple:
    schema = data.get("schema")
    if not isinstance(schema, str):
        raise SpecError(path, "schema", "missing schema id string")
    docs: dict[str, dict[str, str]] = {}
    for section in ("kinds", "strategies"):
        tables = data.get(section)
        if not isinstance(tables, dict) or not tables:
            raise SpecError(path, section, "missing or empty")
        docs[section] = {}
        for name, table in tables.items():
            doc = table.get("doc") if isinstance(table, dict) else None
            if not isinstance(doc, str):
                raise SpecError(path, f"{section}.{name}", "needs a one-line doc string")
            _doc_ok(path, f"{section}.{name}", doc)
            docs[section][name] = doc.strip()
    kinds, strategies = docs["kinds"], docs["strategies"]
    raw = data.get("cells")
    if not isinstance(raw, list) or not raw:
        raise SpecError(path, "cells", "missing or empty")
    cells: dict[tuple[str, bool, bool], RollbackCell] = {}
    for i, entry in enumerate(raw):
        where = f"cells[{i}]"
        if not isinstance(entry, dict):
            raise SpecError(path, where, "must be a table")
        unknown = set(entry) - {"kind", "quantized_kv", "chunked_prefill", "strategy", "refusal", "message"}
        if unknown:
            raise SpecError(path, where, f"unknown keys {sorted(unknown)}")
        kind = entry.get("kind")
        if kind not in kinds:
            raise SpecError(path, f"{where}.kind", f"names unknown cache kind {kind!r}")
        strategy, refusal, message = entry.get("strategy"), entry.get("refusal"), entry.get("message", "")
        if (strategy is None) == (refusal is None):
            raise SpecError(path, where, "needs exactly one of strategy or refusal")
        if strategy is not None and strategy not in strategies:
            raise SpecError(path, f"{where}.strategy", f"names unknown strategy {strategy!r}")
        reason = None
        if refusal is not None:
            if refusal not in RefusalReason.__members__:
                raise SpecError(path, f"{where}.refusal", f"{refusal!r} is not a RefusalReason")
            if not isinstance(message, str) or not message.strip():
                raise SpecError(path, f"{where}.message", "a refusal needs a message")
            reason = RefusalReason(refusal)
        for q in _bools(path, f"{where}.quantized_kv", entry.get("quantized_kv")):
            for c in _bools(path, f"{where}.chunked_prefill", entry.get("chunked_prefill")):
                key = (kind, q, c)
                if key in cells:
                    raise SpecError(path, where, f"covers {key} a second time")
                cells[key] = RollbackCell(kind, q, c, strategy, reason, message)
    for kind in kinds:
        for q in (False, True):
            for c in (False, True):
                if (kind, q, c) not in cells:
                    raise SpecError(
                        path, f"kinds.{kind}", f"no cell for quantized_kv={q}, chunked_prefill={c}"
                    )
    unmergeable: dict[str, Unmergeable] = {}
    raw_unmergeable = data.get("unmergeable", [])
    if not isinstance(raw_unmergeable, list):
        raise SpecError(path, "unmergeable", "must be an array of tables")
    for i, entry in enumerate(raw_unmergeable):
        where = f"unmergeable[{i}]"
        item = _convert(path, where, entry, Unmergeable)
        if item.kind not in kinds:
            raise SpecError(path, f"{where}.kind", f"names unknown cache kind {item.kind!r}")
        if not item.message.strip():
            raise SpecError(path, f"{where}.message", "a refusal needs a message")
        unmergeable[item.kind] = item
    used = {cell.strategy for cell in cells.values()}
    for name in strategies:
        if name not in used:
            raise SpecError(path, f"strategies.{name}", "is declared but no cell uses it")
    return schema, kinds, strategies, cells, unmergeable


def load_registry(families_path: Path | None = None, rollback_path: Path | None = None) -> Registry:
    """Load and check both spec files; raise SpecError naming the first problem."""
    rollback_path = rollback_path or spec_dir() / "rollback.toml"
    families_path = families_path or spec_dir() / "families.toml"
    _, kinds, strategies, cells, unmergeable = parse_rollback(read_toml(rollback_path), str(rollback_path))
    _, families, model_types, sidecar = parse_families(read_toml(families_path), kinds, str(families_path))
    return Registry(families, model_types, sidecar, kinds, strategies, cells, unmergeable)


@cache
def registry() -> Registry:
    """The packaged registry, loaded once."""
    return load_registry()
