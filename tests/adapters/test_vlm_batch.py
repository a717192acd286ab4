"""Batched rows with and without images (melix_mlx.vlm.batch) on the tiny Qwen3.5 VL checkpoints.

One continuous batch: an image row and a text row start together, a second image row
joins late, the text row is removed half-way. Every row's greedy tokens equal mlx-vlm's
own greedy ``generate_step`` for that row alone, token for token, at k = 1 and 2 (the MoE
variant, ``qwen3_5_moe``, at k = 2), with
drafts accepted and rejected (the rows' rope deltas, -2 for an image row, carried across
every step and reshape). The CLI (`melix-fsm generate --vision`) decodes the same rows.
Skipped when mlx-vlm is not installed.
"""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL.Image")

from melix_mlx.vlm import VLMBatchGenerator, prepare, reference  # noqa: E402
from vlm_helpers import IMAGE_PROMPT, TEXT_PROMPT, image, loaded_vl, tiny_vl  # noqa: E402  (tests/adapters on sys.path)

N = 12


@functools.cache
def family_rows(family: str) -> tuple[list, list[list[int]]]:
    """Three rows' inputs (image, text, image) and each one's mlx-vlm greedy tokens, alone."""
    model, processor, _, _ = loaded_vl(family)
    inputs = [
        prepare(model, processor, IMAGE_PROMPT, [image(0)]),
        prepare(model, processor, TEXT_PROMPT),
        prepare(model, processor, IMAGE_PROMPT, [image(1)]),
    ]
    return inputs, [reference(model, row, N) for row in inputs]


@pytest.fixture(scope="module")
def rows():
    return family_rows("qwen3_5")


@pytest.mark.parametrize(("family", "k"), [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5_moe", 2)])
def test_image_and_text_rows_in_one_batch_are_mlx_vlms_greedy(family, k):
    model, _, head, _ = loaded_vl(family)
    inputs, want = family_rows(family)
    gen = VLMBatchGenerator(model, head, num_draft_tokens=k, max_tokens=N)
    first = gen.insert_inputs(inputs[:2])
    got: dict[int, list[int]] = {}
    stats = {}
    for step in range(4 * N):
        _, responses = gen.next()
        for r in responses:
            got.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None and r.uid != first[1]:
                stats[r.uid] = r.stats
        if step == 1:
            late = gen.insert_inputs(inputs[2:])  # joins while the first two decode
        if step == 3:
            gen.remove([first[1]])  # the text row leaves mid-way
        if step > 3 and not len(gen.batch):
            break
    assert got[first[0]] == want[0]
    assert got[late[0]] == want[2]
    text = got[first[1]]
    assert 0 < len(text) < N and text == want[1][: len(text)]
    assert want[0] != want[2]  # the two images give two outputs
    accepted = sum(s.accepted for s in stats.values())
    rejected = sum(s.rejected for s in stats.values())
    assert accepted > 0 and rejected > 0, stats


def test_cli_decodes_image_and_text_rows_together(rows, tmp_path, capsys):
    """`melix-fsm generate --vision` with a JSON prompts file: an image row and a text row in
    one batch, each mlx-vlm's greedy tokens (the tiny tokenizer's EOS never comes first)."""
    from melix_fsm.cli import main

    image(0).save(tmp_path / "a.png")
    table = [{"prompt": "def main(): w", "images": [str(tmp_path / "a.png")]}, TEXT_PROMPT]
    (tmp_path / "rows.json").write_text(json.dumps(table))
    argv = ["generate", "--model", str(tiny_vl()), "--vision", "--prompts-file", str(tmp_path / "rows.json")]
    assert main([*argv, "--max-tokens", "8", "--json", "--device-policy", "force_on"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    _, want = rows
    assert [r["tokens"] for r in out] == [w[:8] for w in want[:2]]  # greedy: a prefix of the longer run
    assert out[0]["vision_tower"].startswith("qwen3_5") and out[0]["method"] == "mtp"
    assert out[0]["stats"]["accepted"] > 0
    bad = ["generate", "--model", str(tiny_vl()), "--prompt", "x", "--image", str(tmp_path / "rows.json")]
    assert main(bad) == 2  # not an image: a usage error
