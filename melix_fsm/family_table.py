"""The family table: every registry family as one markdown row, for the docs site.

Rules of this module:
- Everything in a row is read from spec/families.toml and spec/rollback.toml (the loaded
  registry): support, head layout, cache kinds and the rollback strategy of each, whether
  a batch can hold the family's caches. Nothing about a family is written here.
- Measured figures (engine efficiency at a controlled acceptance) are not spec: the
  caller passes them in, keyed by family name, and a family without one says so.
- No mlx and no file access beyond the registry's own.
"""

from __future__ import annotations

from collections.abc import Mapping

from .registry import Concat, Family, NormRepair, Registry, Support, registry

FAMILIES_TABLE_MARK = "<!-- melix-docs: families-table -->"

_HEADER = (
    "| Family (`model_type`) | What people run | MTP | Head layout | Caches: rollback | Batched "
    "| Identity verified | Efficiency at p = 0.8 per shape (batch 1 / batch 4) |",
    "|---|---|---|---|---|---|---|---|",
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def head_layout(fam: Family) -> str:
    """Where the head's tensors live and how it is wired, or '-' for a family without one."""
    if fam.support is not Support.mtp or fam.weights is None:
        return "-"
    norms = "(1 + w) norms" if fam.norm_repair is NormRepair.plus_one else "plain norms"
    concat = "embedding first" if fam.concat is Concat.embedding_first else "hidden first"
    chain = f"chains {fam.chain.value.replace('_', '-')}" if fam.chain is not None else ""
    return f"`{fam.weights.layer}`; {concat}; {norms}; {chain}"


def caches(fam: Family, reg: Registry) -> str:
    """Each cache kind with the strategy spec/rollback.toml gives it (plain KV, no chunking)."""
    parts = []
    for kind in fam.cache_kinds:
        cell = reg.cells.get((kind, False, False))
        how = cell.strategy if cell is not None and cell.strategy else "refused"
        parts.append(f"{kind}: `{how}`")
    return ", ".join(parts)


def batched(fam: Family, reg: Registry) -> str:
    """'yes', or the typed reason a batch refuses one of the family's cache kinds."""
    if fam.support is Support.refused:
        return "-"
    for kind in fam.cache_kinds:
        if kind in reg.unmergeable:
            return f"one sequence at a time ({reg.unmergeable[kind].refusal.value})"
    return "yes" if fam.batch_reshape or fam.support is not Support.mtp else "no"


def identity(fam: Family, reg: Registry) -> str:
    """What the admission rule guarantees: a runnable family has greedy-identity tests."""
    if fam.support is not Support.mtp:
        return "-"
    where = "single and batched" if batched(fam, reg) == "yes" else "single-sequence"
    return f"greedy = mlx-lm's, {where} (CPU wheel)"


def support(fam: Family) -> str:
    if fam.support is Support.mtp:
        return "runs"
    if fam.support is Support.refused:
        reason = fam.refusal.value if fam.refusal is not None else "refused"
        return f"refused (`{reason}`): {fam.message}"
    return "no native head (draft model only)"


def family_row(fam: Family, reg: Registry, efficiency: Mapping[str, str]) -> str:
    types = ", ".join(f"`{t}`" for t in fam.model_types)
    cells = (
        f"**{fam.name}** ({types})",
        fam.runs or "-",
        support(fam),
        head_layout(fam),
        caches(fam, reg),
        batched(fam, reg),
        identity(fam, reg),
        efficiency.get(fam.name, "not measured") if fam.support is Support.mtp else "-",
    )
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def families_table(efficiency: Mapping[str, str] | None = None, reg: Registry | None = None) -> str:
    """Every family, runnable first, as a markdown table."""
    reg = reg or registry()
    order = {Support.mtp: 0, Support.refused: 1, Support.no_mtp: 2}
    fams = sorted(reg.families.values(), key=lambda f: (order[f.support], f.name))
    rows = [family_row(f, reg, efficiency or {}) for f in fams]
    return "\n".join([*_HEADER, *rows])
