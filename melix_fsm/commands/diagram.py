"""`melix-fsm diagram`: write or check the diagrams derived from the spec.

Rules of this module:
- Rendering lives in melix_fsm.diagrams; this module only parses arguments, writes files
  and reports. Importing it is cheap (no statemachine, no mlx).
- `--check` writes nothing: it renders the byte-stable files (mermaid, markdown) and
  compares them with those in --out, and (in a source checkout, with the default --out)
  the diagrams embedded in README.md and docs/ (melix_fsm.diagram_copies). Exit status:
  0 fresh, 1 stale or missing (each listed on stderr), 2 usage error. SVG is never
  checked (Graphviz output varies). Writing regenerates the embedded copies too.
- SVG needs Graphviz `dot`, looked up before anything is written. Without it, `--format
  svg` (the user asked for the SVG alone) is an error: one line on stderr, exit 2, nothing
  written; `--format all` (the default) writes the text files and skips the SVG with a
  note, so the command works on machines without Graphviz.
- The SVG goes beside the mermaid source (--out, default the spec's diagrams/), one
  folder per machine's pictures. It is derived and Graphviz-version dependent, so it is
  never tracked: .gitignore lists spec/diagrams/*.svg.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

EXIT_STALE = 1
EXIT_USAGE = 2
GRAPHVIZ_HINT = (
    "install Graphviz (apt-get install graphviz; brew install graphviz) or use --format mermaid|md"
)


def _default_out() -> Path:
    from ..spec import spec_dir

    return spec_dir() / "diagrams"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diagram",
        help="write (or --check) every machine's diagram (and the batch's) in spec/diagrams/",
        description="Render each machine of spec/ (lifecycle, controller, pipeline, request) and "
        "spec/batch.toml as Mermaid, markdown and SVG.",
    )
    parser.add_argument(
        "--format",
        choices=("mermaid", "md", "svg", "all"),
        default="all",
        help="which files to write (default: all; svg needs Graphviz dot)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: the spec's diagrams/ in a source checkout, else ./diagrams)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 listing the mermaid/markdown files that are stale",
    )
    parser.set_defaults(run=run)


def _checkout_root() -> Path | None:
    """The source checkout holding the spec (None for an installed package)."""
    from ..spec import spec_dir

    root = spec_dir().parent
    return root if (root / "README.md").is_file() and (root / "spec").is_dir() else None


def _render_copy(name: str) -> str | None:
    from .. import diagrams

    render = diagrams.TEXT_RENDERERS.get(name)
    return render() if render is not None and name.endswith(".mmd") else None


def run(args: argparse.Namespace) -> int:
    from .. import diagram_copies, diagrams

    out: Path = args.out if args.out is not None else _default_out()
    names = diagrams.FORMATS[args.format]
    root = _checkout_root() if args.out is None else None  # pages only beside the default output
    if args.out is None and root is None and not args.check:
        # an installed package: its spec/diagrams/ lies in site-packages, which is no place
        # to write; the working directory is
        out = Path("diagrams")
        print(f"melix-fsm diagram: note: not a source checkout; writing to {out.resolve()}", file=sys.stderr)
    if args.check:
        stale = []
        for name, fresh in diagrams.render_text(names).items():
            path = out / name
            if not path.is_file() or path.read_bytes() != fresh:
                stale.append(path)
        if root is not None:
            stale += diagram_copies.stale_pages(root, _render_copy)
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        if stale:
            print("run `melix-fsm diagram` to regenerate", file=sys.stderr)
            return EXIT_STALE
        print(f"diagrams in {out} are fresh")
        return 0

    want_svg = any(name in diagrams.SVG_FILES for name in names)
    if want_svg and shutil.which("dot") is None:
        if args.format == "svg":  # asked for the SVGs alone: nothing to do without Graphviz
            print(
                f"melix-fsm diagram: error: --format svg needs Graphviz `dot`: {GRAPHVIZ_HINT}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print("melix-fsm diagram: note: Graphviz `dot` not found; skipping the .svg files", file=sys.stderr)
        want_svg = False
    out.mkdir(parents=True, exist_ok=True)
    files = diagrams.render_text(names)
    for svg_name, machine in diagrams.SVG_FILES.items():
        if want_svg and svg_name in names:
            svg = diagrams.render_svg(machine)
            if svg is not None:
                files[svg_name] = svg
    for name, data in files.items():
        path = out / name
        # Leave unchanged files alone, so their mtimes (and make-style rebuilds) stay quiet.
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
        print(path)
    if root is not None:
        for page in diagram_copies.write_pages(root, _render_copy):
            print(page)
    return 0
