"""Benchmark prompts per workload, from held-out text the embedded checkpoints never saw.

Rules of this module:
- Acceptance depends on the text more than on the engine, so the bench reports it per
  workload: `code` (source windows), `prose` (docstrings and comments), `structured`
  (JSON and CSV text derived from the same sources). Each prompt is a few hundred tokens
  of context, cut at a line boundary.
- Sources are the running interpreter's standard library files that the checkpoint's
  `training_report.json` lists as held out (never seen by its tokenizer or model). A
  model without that report falls back to the same rule the training script uses
  (`HELD_OUT_EVERY` / `HELD_OUT_OFFSET` over the sorted top-level files).
- `from_file` reads a user's own prompts: one prompt per blank-line-separated block, or
  a JSON list of strings; each gets the workload name "custom".
- Deterministic: same files, same cuts.
"""

from __future__ import annotations

import ast
import io
import json
import sysconfig
import tokenize
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_EVERY = 10
HELD_OUT_OFFSET = 3
PROMPT_CHARS = 1200  # ~300-400 tokens with the embedded tokenizer
PER_WORKLOAD = 3


@dataclass(frozen=True)
class Prompt:
    workload: str
    text: str
    source: str


def held_out_files(model_dir: Path | None = None) -> list[Path]:
    """The held-out standard-library files for `model_dir` (its report, else the rule)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    report = (model_dir / "training_report.json") if model_dir is not None else None
    if report is not None and report.exists():
        names = json.loads(report.read_text()).get("data", {}).get("held_out_files")
        if names:
            return [root / n for n in names if (root / n).exists()]
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_sysconfigdata"))
    return [p for i, p in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_OFFSET]


def _cut(text: str, start: int = 0) -> str:
    """About PROMPT_CHARS of `text` from `start`, ending at a line boundary."""
    chunk = text[start : start + PROMPT_CHARS]
    end = chunk.rfind("\n")
    return chunk[: end + 1] if end > PROMPT_CHARS // 2 else chunk


def _code(source: str) -> str:
    """A window starting at the first top-level def or class past the module header."""
    lines = source.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
    if not starts:
        return _cut(source)
    offset = sum(len(line) for line in lines[: starts[0]])
    return _cut(source, offset)


def _prose(source: str) -> str:
    """Docstrings and comments, in file order."""
    parts: list[str] = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc.strip() + "\n\n")
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and len(tok.string) > 12:
                parts.append(tok.string + "\n")
    except (tokenize.TokenError, IndentationError):
        pass
    return _cut("".join(parts))


def _structured(source: str, name: str) -> str:
    """JSON records of the file's functions, then the same as CSV."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    records = [
        {"module": name, "name": n.name, "line": n.lineno, "args": [a.arg for a in n.args.args]}
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    text = json.dumps(records[:12], indent=1) + "\n"
    text += "module,name,line,n_args\n" + "".join(
        f"{r['module']},{r['name']},{r['line']},{len(r['args'])}\n" for r in records[12:40]
    )
    return _cut(text)


def held_out_prompts(model_dir: Path | None = None, per_workload: int = PER_WORKLOAD) -> list[Prompt]:
    """`per_workload` prompts of each workload from distinct held-out files."""
    out: list[Prompt] = []
    counts = {"code": 0, "prose": 0, "structured": 0}
    for path in held_out_files(model_dir):
        source = path.read_text(encoding="utf-8", errors="replace")
        made = {"code": _code(source), "prose": _prose(source), "structured": _structured(source, path.stem)}
        for workload, text in made.items():
            if counts[workload] < per_workload and len(text) > PROMPT_CHARS // 2:
                out.append(Prompt(workload, text, path.name))
                counts[workload] += 1
        if all(n >= per_workload for n in counts.values()):
            break
    return out


def from_file(path: Path) -> list[Prompt]:
    """A user's prompts: a JSON list of strings, or blocks separated by blank lines."""
    text = path.read_text(encoding="utf-8")
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        items = [block for block in text.split("\n\n") if block.strip()]
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items) or not items:
        raise ValueError(f"{path}: expected a JSON list of strings or blank-line-separated prompts")
    return [Prompt("custom", item, path.name) for item in items]
