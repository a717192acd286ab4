"""Cross-check: the registry's prefixes match the adapters' real HF-layout and converted checkpoints.

Skipped without mlx (the core never needs it). The tiny checkpoints come from
melix_mlx.tools.tiny (upstream tensor names) and melix_mlx.loading.convert (the melix_mtp format).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from melix_mlx.tools.tiny import make_tiny  # noqa: E402

from melix_fsm.receipt import Mode, resolve  # noqa: E402


@pytest.mark.parametrize("sidecar", [False, True])
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "mimo"])
def test_tiny_hf_checkpoints_are_admitted(tmp_path: Path, family: str, sidecar: bool) -> None:
    path = make_tiny(family, tmp_path / family, head_in_sidecar=sidecar, num_hidden_layers=2)
    r = resolve(path)
    assert r.mode is Mode.accepted, r.message
    assert r.head_format == "hf" and r.weights_present and not r.missing_weights
    assert r.head_files == (["mtp.safetensors"] if sidecar else ["model.safetensors"])


def test_converted_checkpoint_is_admitted(tmp_path: Path) -> None:
    from melix_mlx.loading.convert import convert

    out = convert(make_tiny("mimo", tmp_path / "hf", num_hidden_layers=2), tmp_path / "mlx")
    r = resolve(out)
    assert r.mode is Mode.accepted and r.head_format == "melix", r.message
