"""The docs site builds with `mkdocs build --strict`, and every machine page shows its diagram.

Rules of this file:
- The site is built once into tmp (never into site/). The build runs the hook
  docs/hooks/melix_docs.py, which generates the machine pages and the CLI reference.
- Each machine page is opened in headless Chromium, driven over the DevTools protocol on
  a pipe (--remote-debugging-pipe: no port, no network, no extra package). The page's
  inline SVG must hold one node per state of the spec (one per batch operation on the
  batch page), every node must be laid out, and a screenshot of the diagram must not be
  blank.
- Without mkdocs, Graphviz `dot` or Chromium the test skips with the reason, except under
  CI (the CI environment variable set, or MELIX_DOCS_REQUIRED as .ci/run sets it), where
  it fails instead.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import time
import tomllib
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from melix_fsm import diagrams
from melix_fsm.cli import build_parser
from melix_fsm.invariants import BATCH_SPEC
from melix_fsm.spec import MACHINES

ROOT = Path(__file__).resolve().parents[2]
PAGES = (*MACHINES, "batch")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--window-size=1280,900",
    "--remote-debugging-pipe",
)


def _in_ci() -> bool:
    flags = (os.environ.get(name, "").strip().lower() for name in ("CI", "MELIX_DOCS_REQUIRED"))
    return any(flag not in ("", "0", "false", "no") for flag in flags)


def _require(ok: bool, reason: str) -> None:
    """Skip for want of a tool, except under CI, which installs every tool this file needs."""
    if ok:
        return
    if _in_ci():
        pytest.fail(f"{reason} (CI installs it: see .ci/run)")
    pytest.skip(reason)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings") if importlib.util.find_spec(m) is None]
    _require(not missing, f"the docs extra is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    _require(shutil.which("dot") is not None, "Graphviz `dot` is not installed (apt-get install graphviz)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    config = str(ROOT / "mkdocs.yml")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _page(site: Path, name: str) -> Path:
    return site / "machines" / f"{name}.html"


def _expected_nodes(name: str) -> set[str]:
    """The node names `dot` writes as <title>s: one per state (or batch operation)."""
    if name == "batch":
        parts = {"batch", "row", "machine", "counters", "payload", "retired"}
        return parts | {f"op_{op}" for op in BATCH_SPEC.operations}
    return set(diagrams.machine_specs()[name].states) | {"__start"}


def _expected_edges(name: str) -> int:
    if name == "batch":
        return 5 + len(BATCH_SPEC.operations)
    spec = diagrams.machine_specs()[name]
    return len({(t.source, t.target) for t in spec.transitions}) + 1  # merged pairs + the start arrow


# -- the built HTML ------------------------------------------------------------------


def test_every_machine_page_has_its_svg(site: Path) -> None:
    for name in PAGES:
        text = _page(site, name).read_text(encoding="utf-8")
        block = re.search(rf'<div class="melix-diagram" data-machine="{name}">\s*<svg(.*?)</svg>', text, re.S)
        assert block is not None, f"{name}: no inline diagram"
        titles = re.findall(r'<g id="node\d+" class="node">\s*<title>([^<]*)</title>', block.group(1))
        assert sorted(titles) == sorted(_expected_nodes(name)), name
        assert len(re.findall(r'class="edge"', block.group(1))) == _expected_edges(name), name
        assert "```mermaid" not in text and 'class="mermaid"' not in text, name


def test_machine_pages_carry_the_spec_tables(site: Path) -> None:
    for name, spec in diagrams.machine_specs().items():
        text = _page(site, name).read_text(encoding="utf-8")
        for state in spec.states:
            assert f"<code>{state}</code>" in text, (name, state)
        for event in spec.events:
            assert f"<code>{event}</code>" in text, (name, event)
    batch = _page(site, "batch").read_text(encoding="utf-8")
    for op in BATCH_SPEC.operations:
        assert f"<code>{op}</code>" in batch, op


def test_no_resource_from_the_network(site: Path) -> None:
    # Viewing needs no network: no script, stylesheet, font or image from another host.
    remote = re.compile(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="(?:https?:)?//', re.I)
    for html_file in site.rglob("*.html"):
        match = remote.search(html_file.read_text(encoding="utf-8"))
        assert match is None, f"{html_file.relative_to(site)}: {match.group(0) if match else ''}"


def test_cli_reference_lists_every_command_and_option(site: Path) -> None:
    text = (site / "cli.html").read_text(encoding="utf-8")
    parser = build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert subs.choices
    for name, sub in subs.choices.items():
        assert f'id="melix-fsm-{name}"' in text, name
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:
                continue  # hidden from --help, so from the reference too
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"<code>{flag}" in text, (name, flag)


def test_families_page_has_a_row_per_registry_family(site: Path) -> None:
    from melix_fsm.registry import registry

    text = (site / "families.html").read_text(encoding="utf-8")
    assert "melix-docs: families-table" not in text  # the hook replaced its marker
    rows = re.findall(r"<tr>\s*<td><strong>([a-z0-9_]+)</strong>", text)
    assert sorted(rows) == sorted(registry().families)


def test_overview_links_every_machine(site: Path) -> None:
    source = (ROOT / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    built = (site / "lifecycle.html").read_text(encoding="utf-8")
    for name in PAGES:
        assert f"](../spec/diagrams/{name}.md)" in source, name  # resolves on GitHub
        assert f'href="machines/{name}.html"' in built, name  # and on the site
    for spec in diagrams.machine_specs().values():
        for state in spec.states:
            assert f"<code>{state}</code>" in built, state


def test_docstring_lists_get_their_blank_line() -> None:
    _require(importlib.util.find_spec("griffe") is not None, "griffe (docs extra) is not installed")
    loaded = importlib.util.spec_from_file_location("griffe_lists", ROOT / "docs/hooks/griffe_lists.py")
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    text = "Rules:\n- one\n  more\n- two\n\nAfter.\n1. a"
    assert module.spaced(text) == "Rules:\n\n- one\n  more\n- two\n\nAfter.\n\n1. a"
    assert module.spaced("- first line\n- second") == "- first line\n- second"


def test_home_page_names_every_extra() -> None:
    # The extras table of docs/index.md against pyproject.toml, both ways.
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    home = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    named = set(re.findall(r"^\| `([a-z0-9_-]+)` \|", home, re.M))
    assert named == extras
    assert "mkdocs serve" in home


def test_api_reference_renders_docstrings(site: Path) -> None:
    for page, symbol in (
        ("machine", "CompiledMachine"),
        ("lifecycle", "SequenceMachine"),
        ("batch", "Batch"),
        ("controller", "LiveController"),
        ("generate", "mtp_stream_generate"),
        ("batch_generator", "MTPBatchGenerator"),
        ("loading", "load_with_heads"),
    ):
        text = (site / "api" / f"{page}.html").read_text(encoding="utf-8")
        assert 'class="doc doc-heading"' in text and symbol in text, page


# -- Chromium over the DevTools pipe -------------------------------------------------


class DevTools:
    """A minimal DevTools-protocol client over Chromium's --remote-debugging-pipe (fds 3, 4)."""

    def __init__(self, chromium: str, profile: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire() -> None:  # in the child: the protocol wants commands on fd 3, replies on fd 4
            r, w = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self._log = profile / "chromium.log"  # a file, not a pipe nobody drains while it runs
        with self._log.open("wb") as log:
            self.proc = subprocess.Popen(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=wire,
                pass_fds=(3, 4),
            )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed the pipe: {self._stderr_tail()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _stderr_tail(self) -> str:
        self.proc.kill()
        self.proc.wait()
        return self._log.read_text(errors="replace")[-2000:]

    def send(self, method: str, session: str | None = None, timeout: float = 30, **params: Any) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read(deadline))

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.send("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture(scope="module")
def browser(site: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevTools, str]]:
    chromium = _chromium()
    _require(chromium is not None, "Chromium is not installed (apt-get install chromium)")
    assert chromium is not None
    tools = DevTools(chromium, tmp_path_factory.mktemp("chromium-profile"))
    try:
        target = next(t for t in tools.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        session = tools.send("Target.attachToTarget", targetId=target["targetId"], flatten=True)["sessionId"]
        tools.send("Page.enable", session)
        yield tools, session
    finally:
        tools.close()


# What the page shows: the diagram's box, and each node's name and laid-out size.
_MEASURE = """(() => {
  const svg = document.querySelector('.melix-diagram svg');
  if (!svg) return null;
  const box = svg.getBoundingClientRect();
  const nodes = [...svg.querySelectorAll('g.node')].map(g => {
    const r = g.getBoundingClientRect();
    return {name: g.querySelector('title').textContent, width: r.width, height: r.height};
  });
  return {x: box.x + window.scrollX, y: box.y + window.scrollY, width: box.width, height: box.height, nodes};
})()"""


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG (Chromium's)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw, stride, rows = zlib.decompress(idat), width * bpp, []
    prev = bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, stride, bpp)]


def _ink(png: bytes) -> tuple[int, int]:
    """(inked pixels, all pixels): ink = the strokes and text (anti-aliased: grey) on white."""
    width, height, pixels = _png_pixels(png)
    ink = sum(1 for p in pixels if min(p) < 200)
    return ink, width * height


def test_png_reader_counts_ink() -> None:
    # A 3x2 RGB image, rows filtered None and Sub: one black pixel among white ones.
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"\x00" + b"\xff\xff\xff" * 2 + b"\x00\x00\x00" + b"\x01" + b"\xff\xff\xff" + b"\x00\x00\x00" * 2
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 2, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    assert _ink(png) == (1, 6)


@pytest.mark.parametrize("name", PAGES)
def test_diagram_renders_in_chromium(site: Path, browser: tuple[DevTools, str], name: str) -> None:
    tools, session = browser
    tools.events.clear()
    tools.send("Page.navigate", session, url=_page(site, name).as_uri())
    tools.wait_event("Page.loadEventFired")
    measured = tools.send("Runtime.evaluate", session, expression=_MEASURE, returnByValue=True)
    shown = measured["result"]["value"]
    assert shown is not None, f"{name}: the page has no diagram"
    assert sorted(n["name"] for n in shown["nodes"]) == sorted(_expected_nodes(name))
    for node in shown["nodes"]:
        least = 1 if node["name"] == "__start" else 20  # the start mark is a dot; states are boxes
        assert node["width"] > least and node["height"] > 1, (name, node)  # laid out, not collapsed
    assert shown["width"] > 200 and shown["height"] > 50, (name, shown["width"], shown["height"])
    clip = {k: shown[k] for k in ("x", "y", "width", "height")} | {"scale": 1}
    shot = tools.send("Page.captureScreenshot", session, format="png", clip=clip, captureBeyondViewport=True)
    ink, total = _ink(base64.b64decode(shot["data"]))
    # Strokes and labels cover a small, non-zero part of the box: neither blank nor a solid fill.
    assert 0.005 * total < ink < 0.5 * total, (name, ink, total)
