"""The CLI's edges a new user meets first: names, missing extras, Graphviz, progress, outputs.

Rules of this file:
- No mlx is needed: a missing module is simulated by setting it to None in sys.modules
  (importlib then reports it absent, and importing it raises ImportError).
- Nothing is written outside tmp_path.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from melix_fsm.cli import EXIT_OK, EXIT_USAGE, build_parser, main, plugin_packages, resolve_model
from melix_fsm.commands.extras import install_hint, messages, missing
from melix_fsm.commands.paths import cache_dir, default_output
from melix_fsm.commands.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


def _embedded(name: str) -> Path:
    found = Path(resolve_model(name))
    if not (found / "config.json").is_file():
        pytest.skip(f"embedded checkpoint {name} not installed")
    return found


# -- embedded names -------------------------------------------------------------------------


def test_receipt_accepts_the_embedded_names(capsys: pytest.CaptureFixture[str]) -> None:
    tiny, draft = _embedded("stdlib-tiny"), _embedded("stdlib-tiny-draft")
    assert main(["receipt", "stdlib-tiny"]) == EXIT_OK
    assert Path(json.loads(capsys.readouterr().out)["model"]) == tiny
    argv = ["receipt", "stdlib-tiny", "--method", "draft_model", "--draft-model", "stdlib-tiny-draft"]
    assert main(argv) == EXIT_OK
    receipt = json.loads(capsys.readouterr().out)
    assert receipt["resolved_method"] == "draft_model" and Path(receipt["draft_model"]) == draft


def test_a_directory_of_that_name_wins_over_the_embedded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _embedded("stdlib-tiny")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stdlib-tiny").mkdir()  # the user's own (empty) directory: unreadable, not ours
    assert main(["receipt", "stdlib-tiny"]) == EXIT_USAGE
    assert "unreadable_checkpoint" in capsys.readouterr().err
    assert resolve_model("no-such-model") == "no-such-model"


def test_receipt_resolves_embedded_names_without_mlx() -> None:
    _embedded("stdlib-tiny")
    code = (
        "import sys; sys.modules['mlx'] = sys.modules['mlx_lm'] = None\n"
        "from melix_fsm.cli import main\n"
        "status = main(['receipt', 'stdlib-tiny'])\n"
        "loaded = [m for m, mod in sys.modules.items() if mod and m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
        "assert loaded == [], loaded\n"
        "sys.exit(status)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_OK, done.stderr
    assert json.loads(done.stdout)["mode"] in ("accepted", "admitted")


# -- missing optional dependencies -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv,module,extra",
    [
        (["bench", "--batch-sizes", "1"], "matplotlib", "bench"),
        (["serve", "--port", "0"], "prometheus_client", "serve"),
        (["generate", "--prompt", "x"], "mlx_lm", "mlx"),
        (["calibrate"], "mlx", "mlx"),
        (["qa", "target", "--model", "stdlib-tiny"], "hypothesis", "qa"),
    ],
)
def test_a_missing_extra_is_one_line_before_any_work(
    argv: list[str],
    module: str,
    extra: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setenv("MELIX_FSM_CACHE", str(tmp_path / "cache"))
    parser = build_parser()
    if argv[0] not in parser._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        pytest.skip(f"{argv[0]} is not a command here")
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert err == f'melix-fsm {argv[0]}: needs {module}: pip install "melix-fsm[{extra}]"\n'
    assert out == "" and not (tmp_path / "cache").exists()  # nothing ran, nothing written


def test_without_mlx_the_mlx_commands_name_one_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mlx", None)
    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    assert main(["generate", "--prompt", "x"]) == EXIT_USAGE
    assert capsys.readouterr().err == 'melix-fsm generate: needs mlx, mlx_lm: pip install "melix-fsm[mlx]"\n'


def test_declared_requirements_name_the_extra_that_installs_them() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    provided = {
        name: {re.split(r"[\[<>=;! ]", req, maxsplit=1)[0].lower().replace("-", "_") for req in reqs}
        for name, reqs in extras.items()
    }
    declared = []
    for package in plugin_packages():
        declared += list(getattr(package, "DEFAULT_REQUIRES", ()))
        for pairs in getattr(package, "REQUIRES", {}).values():
            declared += list(pairs)
    assert declared, "the mlx commands declare what they need"
    wrong = [(module, extra) for module, extra in declared if module not in provided.get(extra, set())]
    assert wrong == []


def test_every_plugin_command_needs_mlx_and_the_core_commands_nothing() -> None:
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, sub in choices.items():
        requires = sub.get_default("requires")
        if name in ("receipt", "diagram"):
            assert requires is None
        else:
            assert ("mlx", "mlx") in requires, name


def test_the_serve_extra_brings_the_readme_client() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("openai") for req in extras["serve"])
    assert any(req.startswith("prometheus_client") for req in extras["serve"])


def test_missing_finds_absent_modules_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    wanted = [("json", "x"), ("matplotlib", "bench"), ("matplotlib", "bench"), ("no_such_mod_xyz", "y")]
    assert missing(wanted) == [("matplotlib", "bench"), ("no_such_mod_xyz", "y")]
    assert install_hint(["mlx", "bench", "mlx"]) == 'pip install "melix-fsm[mlx,bench]"'
    absent = [("mlx", "mlx"), ("mlx_lm", "mlx"), ("matplotlib", "bench")]
    assert messages("melix-fsm bench", absent) == [
        'melix-fsm bench: needs mlx, mlx_lm: pip install "melix-fsm[mlx]"',
        'melix-fsm bench: needs matplotlib: pip install "melix-fsm[bench]"',
    ]


# -- diagram --format svg without Graphviz --------------------------------------------------


def test_svg_without_graphviz_is_an_error_and_all_skips_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` anywhere
    out = tmp_path / "out"
    assert main(["diagram", "--format", "svg", "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "needs Graphviz `dot`" in err and "install Graphviz" in err and not out.exists()
    assert main(["diagram", "--format", "all", "--out", str(out)]) == EXIT_OK
    assert "skipping the .svg files" in capsys.readouterr().err
    assert (out / "lifecycle.mmd").is_file() and not (out / "lifecycle.svg").exists()


def test_default_svg_location_is_ignored_by_git() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/spec/diagrams/*.svg" in ignored and "/bench-results/" in ignored


# -- progress ---------------------------------------------------------------------------------


def test_progress_off_a_terminal_is_a_few_plain_lines() -> None:
    stream = io.StringIO()  # not a TTY
    with Progress(25, "bench runs", stream=stream) as bar:
        bar.note("calibrating")
        for _ in range(25):
            bar.update(1)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "bench runs: calibrating" and lines[-1] == "bench runs: 25/25"
    assert len(lines) == 11  # the note, then one line per tenth


def test_progress_says_where_it_stopped_and_is_silent_when_off() -> None:
    stream = io.StringIO()
    bar = Progress(100, "calibrate", stream=stream)
    bar.update(5)
    bar.close()
    assert stream.getvalue() == "calibrate: 5/100\n"
    quiet = io.StringIO()
    bar = Progress(3, "calibrate", enabled=False, stream=quiet)
    bar.note("loading")
    bar.update(3)
    bar.close()
    assert quiet.getvalue() == "" and bar.count == 3


def test_progress_on_a_terminal_is_a_tqdm_bar() -> None:
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with Progress(4, "bench runs", stream=stream) as bar:
        bar.update(4)
    assert "\r" in stream.getvalue() and "4/4" in stream.getvalue()


# -- output directories -----------------------------------------------------------------------


def test_outputs_default_to_the_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MELIX_FSM_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and default_output("bench") == tmp_path / "c" / "bench"
    monkeypatch.delenv("MELIX_FSM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "melix-fsm"
    assert build_parser().parse_args(["bench"]).out is None  # resolved to the cache when run
