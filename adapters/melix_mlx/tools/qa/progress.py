"""Progress of a long `melix-fsm qa` run, on stderr (stdout keeps the report or the JSON).

Rules of this module:
- On a terminal, with tqdm installed, one tqdm bar counts the schedules run; elsewhere
  (a log, a CI job, tqdm absent) plain lines, one per phase, round and bug: never
  carriage-return updates into a file.
- `Progress(...)(kind, value)` is the callable the kit's hunt and draws call
  (melix_fsm.testing: "round", "example", "probe", "bug", "draws", "phase").
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    def __init__(
        self, stream: TextIO | None = None, *, enabled: bool = True, prog: str = "melix-fsm qa"
    ) -> None:
        self.stream = stream or sys.stderr
        self.prog = prog
        self.enabled = enabled
        self.bar: Any = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(file=self.stream, unit=" schedules", desc=prog.split()[-1], leave=False)

    def __call__(self, kind: str, value: Any = None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            if kind in ("example", "probe"):
                self.bar.update(1)
            elif kind in ("round", "phase", "bug"):
                self.bar.set_description(f"qa {kind} {value}")
            return
        if kind in ("round", "phase", "bug"):
            print(f"{self.prog}: {kind} {value}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
