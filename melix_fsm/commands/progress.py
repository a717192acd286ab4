"""Progress of a long command on stderr: a tqdm bar on a terminal, a few plain lines elsewhere.

Rules of this module:
- On a TTY (and with tqdm installed) a tqdm bar. Elsewhere (a log file, CI, a pipe) no
  carriage returns: one plain line each time the count crosses another tenth of the total,
  so a log gets at most eleven lines per bar and still shows that the command is alive.
- `enabled=False` shows nothing (the commands' --no-progress); the counting still works.
- No mlx import; tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

STEPS = 10  # plain lines per bar when not on a terminal


class Progress:
    """`update(n)` after each unit of work, `close()` at the end (also a context manager)."""

    def __init__(
        self, total: int, desc: str, *, unit: str = "run", enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(total, 0)
        self.desc = desc
        self.count = 0
        self._stream = stream if stream is not None else sys.stderr
        self._shown = 0  # the last tenth printed as a plain line
        self._bar: Any = None
        self._plain = False
        if enabled:
            self._bar = _tqdm_bar(self.total, desc, unit, self._stream)
            self._plain = self._bar is None

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._plain and self.total:
            tenth = min(self.count, self.total) * STEPS // self.total
            if tenth > self._shown:
                self._shown = tenth
                self._line()

    def note(self, text: str) -> None:
        """A phase that is not counted (loading, calibrating), shown without breaking the bar."""
        if self._bar is not None:
            self._bar.set_postfix_str(text)
        elif self._plain:
            print(f"{self.desc}: {text}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain and self._shown < STEPS and self.count and self.count != self.total:
            self._line()  # stopped early: say where
        self._plain = False

    def _line(self) -> None:
        print(f"{self.desc}: {min(self.count, self.total)}/{self.total}", file=self._stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tqdm_bar(total: int, desc: str, unit: str, stream: TextIO) -> Any:
    """A tqdm bar when `stream` is a terminal and tqdm is installed, else None."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=stream)
