"""Every script under examples/ runs as a user would run it, and says what it shows.

Each runs in a subprocess from a directory outside the checkout (the package is imported
as installed, not from the working directory) on the embedded stdlib-tiny checkpoint.
The examples check their own claims (MTP's text equals mlx-lm's; an off run says why);
here their exit status and their key lines are checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

EXPECT = {
    "stream_generate_loop.py": ["(same text as stream_generate)", "mode="],
    "custom_server_loop.py": ["receipt: ", "batched=True", "drafts, state finished"],
    "why_mtp_was_off.py": ["MTP off (operator_disabled)", "{'num_draft_tokens': 'auto'} -> MTP"],
}


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name: str, tmp_path: Path) -> None:
    env = {**os.environ, "MELIX_FSM_CALIBRATION_CACHE": str(tmp_path / "calibration")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for line in EXPECT[name]:
        assert line in done.stdout, f"{name} did not print {line!r}:\n{done.stdout[-2000:]}"
