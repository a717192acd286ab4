"""The committed diagrams in spec/diagrams/ are fresh, stable and derived from the spec.

Rules of this file:
- `melix-fsm diagram --check` must pass on the source tree: a spec edit without
  regenerating the diagrams fails CI here.
- Writing goes to tmp_path only (--out); nothing here touches spec/diagrams/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from melix_fsm import diagrams
from melix_fsm.cli import main
from melix_fsm.lifecycle import SPEC
from melix_fsm.spec import spec_dir

DIAGRAMS = spec_dir() / "diagrams"


def test_committed_diagrams_are_fresh(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--check"]) == 0, capsys.readouterr().err


def test_write_then_check(tmp_path: Path) -> None:
    assert main(["diagram", "--format", "all", "--out", str(tmp_path)]) == 0
    for name in diagrams.TEXT_RENDERERS:
        assert (tmp_path / name).read_bytes() == (DIAGRAMS / name).read_bytes()
    assert main(["diagram", "--check", "--out", str(tmp_path)]) == 0


def test_modified_copy_is_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    md = tmp_path / diagrams.LIFECYCLE_MD
    md.write_bytes(md.read_bytes().replace(b"rolled_back", b"rolled_forward", 1))
    (tmp_path / diagrams.BATCH_MD).unlink()
    capsys.readouterr()
    assert main(["diagram", "--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(md) in err and diagrams.BATCH_MD in err
    assert diagrams.LIFECYCLE_MMD not in err  # the untouched file is not reported
    # --format narrows the check
    assert main(["diagram", "--check", "--format", "mermaid", "--out", str(tmp_path)]) == 0


def test_rendering_is_byte_stable() -> None:
    first = diagrams.render_text()
    second = diagrams.render_text()
    assert first == second
    for name, data in first.items():
        text = data.decode("utf-8")
        assert text.endswith("\n") and not text.endswith("\n\n"), name
        assert "\r" not in text and " 0x" not in text, name


def test_diagram_covers_every_transition() -> None:
    mmd = diagrams.lifecycle_mermaid()
    lines = mmd.splitlines()
    for t in SPEC.transitions:
        label = f"{t.event} [{t.guard_label}]" if t.guard else t.event
        edge = f"    {t.source} --> {t.target} : "
        assert any(line.startswith(edge) and label in line for line in lines), t
    assert f"[*] --> {SPEC.initial}" in mmd
    md = diagrams.lifecycle_markdown()
    for name, state in SPEC.states.items():
        assert f"`{name}`" in md and state.doc in md
    for doc in SPEC.events.values():
        assert doc in md


def test_svg_only_with_graphviz(tmp_path: Path) -> None:
    import shutil

    status = main(["diagram", "--format", "svg", "--out", str(tmp_path)])
    svg = tmp_path / diagrams.LIFECYCLE_SVG
    if shutil.which("dot") is None:  # asked for the SVG alone: a usage error, nothing written
        assert status == 2 and not svg.exists()
    else:
        assert status == 0 and b"<svg" in svg.read_bytes()


# -- copies embedded in pages (README.md, docs/) ------------------------------------------------


def _page(body: str) -> str:
    block = f"<!-- melix-fsm diagram: controller.mmd -->\n{body}\n<!-- /melix-fsm diagram -->"
    return f"# Title\n\n{block}\n\nafter\n"


def test_an_embedded_copy_is_checked_and_rewritten(tmp_path: Path) -> None:
    from melix_fsm import diagram_copies
    from melix_fsm.commands.diagram import _render_copy

    (tmp_path / "docs").mkdir()
    stale = _page("```mermaid\nstateDiagram-v2\n    on --> off : nothing\n```")
    (tmp_path / "README.md").write_text(stale)
    (tmp_path / "docs" / "page.md").write_text("no diagram here\n")
    assert diagram_copies.stale_pages(tmp_path, _render_copy) == [tmp_path / "README.md"]
    assert diagram_copies.write_pages(tmp_path, _render_copy) == [tmp_path / "README.md"]
    fresh = (tmp_path / "README.md").read_text()
    assert diagrams.TEXT_RENDERERS["controller.mmd"]().rstrip("\n") in fresh
    assert fresh.startswith("# Title\n") and fresh.endswith("\nafter\n")
    assert diagram_copies.stale_pages(tmp_path, _render_copy) == []


def test_a_bad_embedded_block_names_the_page() -> None:
    from melix_fsm import diagram_copies
    from melix_fsm.commands.diagram import _render_copy
    from melix_fsm.errors import SpecError

    with pytest.raises(SpecError, match="unknown diagram"):
        diagram_copies.refresh(_page("").replace("controller.mmd", "nope.mmd"), _render_copy, "P.md")
    with pytest.raises(SpecError, match="not closed"):
        unclosed = "<!-- melix-fsm diagram: lifecycle.mmd -->\n```mermaid\n"
        diagram_copies.refresh(unclosed, _render_copy, "P.md")


def test_an_installed_package_writes_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # outside a source checkout the spec's diagrams/ lies in site-packages: never written
    from melix_fsm.commands import diagram

    monkeypatch.setattr(diagram, "_checkout_root", lambda: None)
    monkeypatch.chdir(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in DIAGRAMS.iterdir()}
    assert main(["diagram", "--format", "mermaid"]) == 0
    assert "not a source checkout" in capsys.readouterr().err
    written = sorted(p.name for p in (tmp_path / "diagrams").iterdir())
    assert written and all(name.endswith(".mmd") for name in written)
    assert {p: p.stat().st_mtime_ns for p in DIAGRAMS.iterdir()} == before
