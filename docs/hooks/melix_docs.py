"""MkDocs hooks: the pages generated from the spec and the CLI when the site is built.

Rules of this module:
- Nothing about a machine or a command is written here: every machine page comes from
  `melix_fsm.diagrams` (the same markdown as spec/diagrams/<name>.md), every diagram from
  `melix_fsm.diagrams.lifecycle_dot` run through Graphviz `dot` at build time and inlined
  as SVG (no JavaScript, no network to view), the CLI page from `melix_fsm.cli.build_parser()`.
- The batch has no state machine of its own; its DOT (`batch_dot`) is derived here from
  spec/batch.toml the way `melix_fsm.diagrams.batch_mermaid` derives its flowchart.
- Pages in docs/ link to the spec as they must on GitHub (`../spec/...`); those links are
  rewritten to the site's copies, and a link to a file the site lacks stays broken, so
  `mkdocs build --strict` fails on it.
- Without Graphviz the build warns (strict builds fail) and shows the DOT source instead.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

from melix_fsm import diagrams
from melix_fsm.cli import build_parser
from melix_fsm.family_table import FAMILIES_TABLE_MARK, families_table
from melix_fsm.invariants import BATCH_SPEC
from melix_fsm.spec import MACHINES, BatchSpec, spec_dir

log = logging.getLogger("mkdocs.plugins.melix_docs")

MACHINE_DIR = "machines"  # generated pages: machines/<name>.md, one per machine plus batch
SPEC_COPY_DIR = "spec"  # the spec files, copied so that pages can link to them
CLI_PAGE = "cli.md"
# the engine efficiency per family at a controlled acceptance (benchmarks/bench_controlled_acceptance.py)
EFFICIENCY_RESULTS = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "controlled-acceptance.json"
)
MACHINES_TABLE_MARK = "<!-- melix-docs: machines-table -->"
_DIAGRAM_DIV = '<div class="melix-diagram" data-machine="{name}"></div>'
_MERMAID_BLOCK = re.compile(r"```mermaid\n.*?\n```", re.S)
_SPEC_LINK = re.compile(r"\]\(\.\./spec/([^)#\s]+)(#[^)\s]*)?\)")


def page_names() -> tuple[str, ...]:
    """Every generated machine page, in reading order: the machines, then the batch."""
    return (*MACHINES, "batch")


def batch_dot(batch: BatchSpec = BATCH_SPEC) -> str:
    """DOT source of the batch composition (the same graph as `diagrams.batch_mermaid`)."""
    lines = [
        "digraph batch {",
        '    rankdir=LR; node [shape=box, style=rounded, fontname="Helvetica"];',
        '    edge [fontname="Helvetica", fontsize=9];',
        '    batch [label="Batch: ordered rows; row i = cache row i"];',
        '    row [label="Row: uid"];',
        '    machine [label="SequenceMachine: state (spec/lifecycle.toml)"];',
        '    counters [label="Counters: proposed, accepted, emitted, ..."];',
        '    payload [label="payload: adapter-owned, opaque"];',
        '    retired [label="retired: Counters of rows filtered out"];',
        '    batch -> row [label="0..n, in order"];',
        "    row -> machine; machine -> counters; row -> payload; batch -> retired;",
    ]
    for op in batch.operations.values():
        events = ", ".join(op.lifecycle_events) if op.lifecycle_events else "reshape only"
        lines.append(f'    op_{op.name} [label="{op.name}", shape=oval, style=""];')
        lines.append(f'    op_{op.name} -> batch [label="{events}", style=dashed];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def diagram_dot(name: str) -> str:
    """DOT source of page `name`'s diagram."""
    if name == "batch":
        return batch_dot()
    return diagrams.lifecycle_dot(diagrams.machine_specs()[name])


def render_svg(dot_source: str) -> str | None:
    """`dot -Tsvg` output trimmed for inlining in HTML, or None without Graphviz."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    svg = subprocess.run([dot, "-Tsvg"], input=dot_source, capture_output=True, text=True, check=True).stdout
    svg = svg[svg.index("<svg") :]  # the XML prolog and DOCTYPE are not allowed inline
    svg = re.sub(r"<!--.*?-->\n?", "", svg, flags=re.S)
    # Scale with the page: keep the viewBox, drop dot's fixed size in points.
    return re.sub(r'<svg width="[^"]*" height="[^"]*"', '<svg role="img" class="melix-svg"', svg, count=1)


def machine_page(name: str) -> str:
    """The markdown of a machine page: the generated page, its diagram as a placeholder."""
    specs = diagrams.machine_specs()
    text = diagrams.batch_markdown() if name == "batch" else diagrams.machine_markdown(specs[name])
    header, text = text.split("\n", 1)  # "do not edit" belongs to the spec/diagrams/ copies
    if not header.startswith("<!-- Generated"):
        raise ValueError(f"the generated page of {name} does not start with its header: {header!r}")
    if not _MERMAID_BLOCK.search(text):
        raise ValueError(f"the generated page of {name} has no diagram block to replace")
    source = "batch.toml" if name == "batch" else f"{name}.toml"
    note = (
        f"*Generated at build time from [spec/{source}](../{SPEC_COPY_DIR}/{source}); "
        "the diagram is rendered by Graphviz from the same spec.*"
    )
    body = _MERMAID_BLOCK.sub(lambda _: _DIAGRAM_DIV.format(name=name), text, count=1)
    # Without the table of contents the column is wider, and so is the diagram's text.
    return "---\nhide:\n  - toc\n---\n\n" + body + "\n" + note + "\n"


def machines_table() -> str:
    """Every state of every machine, read from the spec (inserted into the overview page)."""
    rows = [
        "**Every state**, read from the spec files when this site was built:",
        "",
        "| Machine | Initial | Final | States |",
        "|---|---|---|---|",
    ]
    for name, spec in diagrams.machine_specs().items():
        title = spec.title or "The sequence lifecycle"
        finals = ", ".join(f"`{s}`" for s in spec.finals) or "none"
        states = ", ".join(f"`{s}`" for s in spec.states)
        rows.append(f"| [{title}](../spec/diagrams/{name}.md) | `{spec.initial}` | {finals} | {states} |")
    return "\n".join(rows)


def measured_efficiency(path: Path = EFFICIENCY_RESULTS) -> dict[str, str]:
    """Family -> its efficiency per recorded shape: "tiny: batch 1 / batch 4 · <profile>:
    batch 1 / batch 4", each the median and, where recorded, the repeats' quartiles, from
    the controlled-acceptance bench's results (schema /2: one entry per profile; a /1 file
    is the tiny profile alone)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    profiles = data.get("profiles") or {"tiny": {"families": data.get("families", {})}}
    # the tiny checkpoints first, then the widened shapes in their recorded order
    names = sorted(profiles, key=lambda name: name != "tiny")
    out: dict[str, list[str]] = {}
    for name in names:
        for family, cells in profiles[name].get("families", {}).items():
            figures = []
            for key in ("batch_1", "batch_4"):
                median, quartiles = cells.get(key), cells.get(f"{key}_quartiles")
                text = "-" if median is None else f"{median:.2f}"
                if median is not None and quartiles:
                    text += f" ({quartiles[0]:.2f}-{quartiles[1]:.2f})"
                figures.append(text)
            out.setdefault(family, []).append(
                f"{_profile_label(name, profiles[name], cells)}: {' / '.join(figures)}"
            )
    return {family: " · ".join(parts) for family, parts in out.items()}


def _profile_label(name: str, profile: dict, cells: dict) -> str:
    """Where a figure comes from: the shape (`tiny`, or `widths x<scale>, h<hidden>, <layers>
    layers`, what was given), the
    clock the cells were timed on and, where recorded, the machine's load average then."""
    shape = profile.get("shape") or {}
    hidden, layers, scale = shape.get("hidden_size"), shape.get("num_hidden_layers"), shape.get("scale")
    parts = [f"widths x{scale}" if scale else "", f"h{hidden}" if hidden else ""]
    parts.append(f"{layers} layers" if layers else "")
    label = ", ".join(p for p in parts if p) if name != "tiny" and (hidden or layers or scale) else "tiny"
    label += f", {cells.get('clock', 'wall')} clock"
    load = cells.get("load_average")
    if load:
        label += f", load {max(load['start'][0], load['end'][0]):.1f}"
    return label


# -- the CLI reference -------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in registration order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    metavar = ""
    if action.nargs != 0:
        meta = action.metavar or (
            "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
        )
        metavar = " " + (" ".join(meta) if isinstance(meta, tuple) else str(meta))
    return ", ".join(f"`{flag}{metavar}`" for flag in action.option_strings)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(choices)s, %(prog)s
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        text = text % {**params, "prog": prog}
    return _prose(text).replace("|", "\\|")


def _prose(text: str) -> str:
    """Argparse text as one markdown line; `<model>` in a help must not become an HTML tag."""
    return html.escape(" ".join(text.split()), quote=False)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
        return ""
    return f"`{action.default}`"


def _command_section(prog: str, summary: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{prog}`", ""]
    if summary:
        lines += [_prose(summary[0].upper() + summary[1:]) + ".", ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        lines += [_prose(parser.description), ""]
    skip = (argparse._SubParsersAction, argparse._HelpAction)  # subcommands get sections; -h is everywhere
    actions = [a for a in parser._actions if a.help is not argparse.SUPPRESS and not isinstance(a, skip)]
    if actions:
        lines += ["| Argument | Default | Meaning |", "|---|---|---|"]
        lines += [f"| {_flags(a)} | {_default(a)} | {_help(a, prog)} |" for a in actions]
        lines.append("")
    if parser.epilog:
        lines += [_prose(parser.epilog), ""]
    for name, help_text, sub in _subparsers(parser):
        lines += _command_section(f"{prog} {name}", help_text, sub, level + 1)
    return lines


def cli_page(parser: argparse.ArgumentParser | None = None) -> str:
    """The CLI reference: every subcommand with its usage and every argument."""
    parser = parser or build_parser()
    parser.prog = "melix-fsm"
    commands = _subparsers(parser)
    lines = [
        "# Command line",
        "",
        "*Generated at build time from the argparse parsers (`melix_fsm.cli.build_parser()`); "
        "`melix-fsm COMMAND --help` prints the same.*",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        "| Command | What it does |",
        "|---|---|",
    ]
    lines += [f"| [`{name}`](#melix-fsm-{name}) | {_prose(help_text)} |" for name, help_text, _ in commands]
    lines.append("")
    for name, help_text, sub in commands:
        lines += _command_section(f"melix-fsm {name}", help_text, sub, 2)
    return "\n".join(lines).rstrip("\n") + "\n"


# -- hooks ---------------------------------------------------------------------------


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for name in page_names():
        files.append(File.generated(config, f"{MACHINE_DIR}/{name}.md", content=machine_page(name)))
    files.append(File.generated(config, CLI_PAGE, content=cli_page()))
    for path in sorted(spec_dir().glob("*.toml")) + sorted(spec_dir().glob("*.json")):
        files.append(File.generated(config, f"{SPEC_COPY_DIR}/{path.name}", abs_src_path=str(path)))
    return files


def _spec_link(page: Page, match: re.Match[str]) -> str:
    """`../spec/X` as written for GitHub -> the site's page or copy of X, relative to `page`."""
    target, anchor = match.group(1), match.group(2) or ""
    diagram = re.fullmatch(r"diagrams/([a-z_]+)\.md", target)
    site_path = f"{MACHINE_DIR}/{diagram.group(1)}.md" if diagram else f"{SPEC_COPY_DIR}/{target}"
    depth = page.file.src_uri.count("/")
    return f"]({'../' * depth}{site_path}{anchor})"


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if MACHINES_TABLE_MARK in markdown:
        markdown = markdown.replace(MACHINES_TABLE_MARK, machines_table())
    if FAMILIES_TABLE_MARK in markdown:
        markdown = markdown.replace(FAMILIES_TABLE_MARK, families_table(measured_efficiency()))
    if page.file.src_uri.startswith(f"{MACHINE_DIR}/"):
        return markdown  # generated pages link to the site's copies already
    return _SPEC_LINK.sub(lambda m: _spec_link(page, m), markdown)


def on_page_content(html_text: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    def inline(match: re.Match[str]) -> str:
        name = match.group(1)
        source = diagram_dot(name)
        svg = render_svg(source)
        if svg is None:
            log.warning("Graphviz `dot` is not installed: the %s diagram is shown as DOT source", name)
            return f'<pre class="melix-diagram">{html.escape(source)}</pre>'
        return f'<div class="melix-diagram" data-machine="{name}">\n{svg}</div>'

    return re.sub(r'<div class="melix-diagram" data-machine="([a-z_]+)"></div>', inline, html_text)
