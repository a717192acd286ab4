"""Progress of `melix-fsm qa` on stderr: plain lines off a terminal, a bar on one, nothing when quiet."""

from __future__ import annotations

import io

from melix_mlx.tools.qa.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def feed(progress: Progress) -> None:
    progress("phase", "probes")
    for _ in range(30):
        progress("probe", "one request, one token")
    progress("bug", "generator_raised:IndexError@gen.py:next")
    progress("round", "1 (seed 3, 1 bug(s) so far)")
    for _ in range(30):
        progress("example", None)
    progress.close()


def test_plain_lines_off_a_terminal() -> None:
    stream = io.StringIO()
    feed(Progress(stream))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [
        "melix-fsm qa: phase probes",
        "melix-fsm qa: bug generator_raised:IndexError@gen.py:next",
        "melix-fsm qa: round 1 (seed 3, 1 bug(s) so far)",
    ]


def test_a_bar_on_a_terminal_and_silence_when_quiet() -> None:
    stream = Terminal()
    feed(Progress(stream))
    assert "qa" in stream.getvalue() and "melix-fsm qa: phase" not in stream.getvalue()
    quiet = io.StringIO()
    feed(Progress(quiet, enabled=False))
    assert quiet.getvalue() == ""
